"""Hostile checkpoints: each is refused with a one-line LoadError that names the file and the problem,
never a traceback of another type, a hang or a silent misreading."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model.config import ConfigError, GPTConfig
from model.hub import hub_errors
from model.json_file import clip
from model.loading import LoadError, load_weights, official_shapes
from model.safetensors_file import SafetensorsError, SafetensorsFile

CPU = {"device": "cpu"}
SMALL = GPTConfig(n_layer=2, n_head=2, n_embd=8, n_positions=8, vocab_size=16)


def write_checkpoint(directory: Path, config: GPTConfig = SMALL) -> Path:
    """A random-weight checkpoint in the official layout (transformers' prefix), small enough to build per test."""
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    state = {"transformer." + k: torch.randn(shape, generator=g) for k, shape in official_shapes(config).items()}
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return directory


def write_raw(path: Path, header: dict | str, body: bytes = b"") -> Path:
    """A .safetensors file with exactly this header (a dict, or JSON text as it is) and data."""
    text = header if isinstance(header, str) else json.dumps(header)
    raw = text.encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + body)
    return path


def f32(shape: list, begin: int, end: int) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


# --- 0. a hostile value in a message ---------------------------------------------------------------


def nested(depth: int) -> list:
    """A list nested `depth` deep, built without recursion."""
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "value",
    [
        "x" * 1_000_000,
        "line\nbreak\r\u2028",
        [[1] * 1_000_000],
        nested(100_000),  # deeper than Python's recursion allows: json parses less, but higher up the stack
        10**5000,  # more digits than Python prints: computed from smaller numbers (d_in times a factor)
        {"a": nested(100_000)},
    ],
    ids=["megabyte", "line breaks", "long list", "deep", "5000 digits", "deep in an object"],
)
@pytest.mark.parametrize("show", [repr, json.dumps])
def test_clip_gives_one_short_line_and_never_raises(value: object, show: Callable[[object], str]) -> None:
    text = clip(value, show)
    assert len(text) <= 103 and "\n" not in text and "\r" not in text and "\u2028" not in text


def test_clip_shows_a_short_value_whole() -> None:
    assert clip("wte.weight") == "'wte.weight'" and clip([True, None], json.dumps) == "[true, null]"
    assert clip("x" * 200) == "'" + "x" * 99 + "..."


# --- 1. a source that looks like a repo id but is not a valid one ---------------------------------


@pytest.mark.parametrize("source", ["nodir/..", "x/.y", "a--b/c", "x/y."])
def test_an_invalid_repo_id_is_a_load_error(source: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # none of them exists as a path here
    with pytest.raises(LoadError, match=r"^not a local path, and not a valid hub repo id: ") as info:
        load_weights(source, **CPU)
    assert repr(source) in str(info.value) and "\n" not in str(info.value)


def test_hub_errors_turns_the_hub_clients_refusals_into_the_callers_error() -> None:
    from huggingface_hub import hf_hub_download

    bad_repo = pytest.raises(LoadError, match=r"^x: not a local path, and not a valid hub repo id: 'nodir/\.\.'")
    with bad_repo, hub_errors(LoadError, "nodir/..", None, missing=str, offline="", where="x: "):
        hf_hub_download("nodir/..", "cfg.json", local_files_only=True)
    bad_file = pytest.raises(LoadError, match=r"not a valid path in the hub repository 'a/b': Invalid filename '\.\./x")
    with bad_file, hub_errors(LoadError, "a/b", None, missing=str, offline=""):
        hf_hub_download("a/b", "../x/cfg.json", local_files_only=True)
    with pytest.raises(ConfigError), hub_errors(LoadError, "a/b", None, missing=str, offline=""):
        raise ConfigError("a bad config.json")  # the block's own ValueErrors pass through


# --- 2. a malformed model.safetensors.index.json -------------------------------------------------


def sharded(tmp_path: Path) -> Path:
    """SMALL as two shards and their index."""
    ckpt = write_checkpoint(tmp_path / "ckpt")
    state = SafetensorsFile(ckpt / "model.safetensors")
    tensors = {k: state.read(k) for k in state.entries}
    (ckpt / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {k: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, k in enumerate(names)}
    for shard in set(weight_map.values()):
        save_file({k: tensors[k] for k in names if weight_map[k] == shard}, ckpt / shard)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return ckpt


def test_a_sharded_checkpoint_loads(tmp_path: Path) -> None:
    assert load_weights(sharded(tmp_path), **CPU).config == SMALL


@pytest.mark.parametrize(
    ("index", "expected"),
    [
        ({"weight_map": ["a"]}, r'it needs a non-empty "weight_map" object'),
        ({"weight_map": {}}, r'it needs a non-empty "weight_map" object'),
        ({"weight_map": "model.safetensors"}, r'it needs a non-empty "weight_map" object'),
        ([1], r'it needs a non-empty "weight_map" object'),
        ({"weight_map": {"wte.weight": 3}}, r"the shard of tensor 'wte\.weight' must be the name of a file in .*got 3"),
        ({"weight_map": {"wte.weight": "."}}, r"must be the name of a file in .*got '\.'"),
        ({"weight_map": {"wte.weight": ""}}, r"must be the name of a file in .*got ''"),
        ({"weight_map": {"wte.weight": "../../etc/passwd"}}, r"got '\.\./\.\./etc/passwd'"),
        ({"weight_map": {"wte.weight": "sub/model.safetensors"}}, r"got 'sub/model\.safetensors'"),
        ({"weight_map": {"wte.weight": None}}, r"got None"),
    ],
)  # fmt: skip
def test_a_malformed_index(index: object, expected: str, tmp_path: Path) -> None:
    ckpt = sharded(tmp_path)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        LoadError, match=r"model\.safetensors\.index\.json is not a valid safetensors index: .*" + expected
    ):
        load_weights(ckpt, **CPU)


def test_an_index_nested_too_deeply(tmp_path: Path) -> None:
    ckpt = sharded(tmp_path)
    (ckpt / "model.safetensors.index.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(LoadError, match=r"index\.json is not a valid safetensors index: its JSON is nested too deeply"):
        load_weights(ckpt, **CPU)


def test_a_tensor_in_two_shards_names_both_files(tmp_path: Path) -> None:
    ckpt = sharded(tmp_path)
    first = SafetensorsFile(ckpt / "model-00001-of-00002.safetensors")
    key = next(iter(first.entries))
    second = SafetensorsFile(ckpt / "model-00002-of-00002.safetensors")
    tensors = {k: second.read(k) for k in second.entries} | {key: first.read(key)}
    save_file(tensors, ckpt / "model-00002-of-00002.safetensors")
    name = key.removeprefix("transformer.")
    with pytest.raises(
        LoadError,
        match=rf"tensor '{name}' appears twice \(as '{key}' in model-00001-of-00002\.safetensors and '{key}' in "
        r"model-00002-of-00002\.safetensors\)",
    ):
        load_weights(ckpt, **CPU)


# --- 3. a malformed safetensors header -----------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ("[Infinity]", r"\[Infinity\]"),
        ("[NaN]", r"\[NaN\]"),
        ('["4"]', r'\["4"\]'),
        ("[4.0]", r"\[4\.0\]"),
        ("[4.7]", r"\[4\.7\]"),
        ("[true]", r"\[true\]"),
        ("[-4]", r"\[-4\]"),
        ("[18446744073709551616]", r"\[18446744073709551616\]"),  # 2**64
        ("4", "4"),
    ],
)
def test_a_shape_that_is_not_a_list_of_non_negative_integers(shape: str, expected: str, tmp_path: Path) -> None:
    path = write_raw(
        tmp_path / "w.safetensors", f'{{"t": {{"dtype": "F32", "shape": {shape}, "data_offsets": [0, 16]}}}}', bytes(16)
    )
    with pytest.raises(SafetensorsError) as info:
        SafetensorsFile(path)
    message = str(info.value)
    assert message.startswith(
        f"{path}: malformed header entry for tensor 't': its shape must be a list of non-negative"
    )
    assert f"got {expected.replace(chr(92), '')}" in message


@pytest.mark.parametrize(
    "offsets", ["[0, 16, 3]", "[-4, 12]", "[0.0, 16]", "[0, 1.6e1]", '["0", 16]', "[true, 16]", f"[0, {2**64}]"]
)
def test_offsets_that_are_not_two_non_negative_integers(offsets: str, tmp_path: Path) -> None:
    header = f'{{"t": {{"dtype": "F32", "shape": [4], "data_offsets": {offsets}}}}}'
    path = write_raw(tmp_path / "w.safetensors", header, bytes(16))
    with pytest.raises(SafetensorsError, match=r"its data_offsets must be two non-negative integers"):
        SafetensorsFile(path)


def test_a_header_nested_too_deeply(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "w.safetensors", "[" * 100_000 + "]" * 100_000)
    with pytest.raises(SafetensorsError, match=r"is not a safetensors file: its header is nested too deeply"):
        SafetensorsFile(path)


@pytest.mark.parametrize(
    ("header", "name", "where"),
    [
        ({"a": f32([4], 0, 16), "b": f32([4], 8, 24)}, "b", "begin at 8 but tensor 'a' ends at 16"),  # overlap
        ({"a": f32([4], 0, 16), "b": f32([4], 0, 16)}, "[ab]", "begin at 0 but tensor '[ab]' ends at 16"),  # the same
        ({"a": f32([4], 0, 16), "b": f32([4], 20, 36)}, "b", "begin at 20 but tensor 'a' ends at 16"),  # a gap
        ({"a": f32([4], 4, 20)}, "a", "begin at 4 but the data begins at 0"),  # a gap before the first
    ],
)  # fmt: skip
def test_overlapping_or_gapped_offsets_are_refused(header: dict, name: str, where: str, tmp_path: Path) -> None:
    path = write_raw(tmp_path / "w.safetensors", header, bytes(40))
    with pytest.raises(SafetensorsError, match=rf"^{path}: invalid offset for tensor '{name}': its bytes {where} "):
        SafetensorsFile(path)


def test_offsets_out_of_the_headers_order_are_fine(tmp_path: Path) -> None:
    """The official writer orders the data by dtype and name, not as the header lists it; zero-size
    tensors share an offset."""
    body = torch.arange(8, dtype=torch.float32).numpy().tobytes()
    header = {"b": f32([4], 16, 32), "z": f32([0], 16, 16), "a": f32([4], 0, 16), "y": f32([0], 0, 0)}
    st = SafetensorsFile(write_raw(tmp_path / "w.safetensors", header, body))
    assert st.read("b").tolist() == [4, 5, 6, 7] and st.read("a").tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("header", "data", "extra"),
    [
        ({"a": f32([4], 0, 16)}, 16, 1),
        ({"a": f32([4], 0, 16)}, 16, 100),
        ({"a": f32([0], 0, 0)}, 0, 8),
        ({"__metadata__": {"format": "pt"}}, 0, 8),  # no tensors, some bytes
    ],
    ids=["one byte", "a hundred bytes", "after a tensor of no bytes", "no tensors"],
)
def test_bytes_after_the_last_tensor_are_refused(header: dict, data: int, extra: int, tmp_path: Path) -> None:
    """As the official library refuses them ("file not fully covered"): bytes no tensor covers are not a
    safetensors file's, and a reader that skipped them would take a file cut or spliced wrongly for a good one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = write_raw(tmp_path / "w.safetensors", header, bytes(data + extra))
    size = path.stat().st_size
    with pytest.raises(
        SafetensorsError,
        match=rf"^{path}: {extra} bytes after the end of the tensors' data: it ends at byte {size - extra}, the "
        rf"file at byte {size} \(every byte of the data must belong to a tensor\)$",
    ):
        SafetensorsFile(path)
    with pytest.raises(SafetensorError, match="file not fully covered"):
        load_file(path)
    path = write_raw(path, header, bytes(data))  # without them, both read it
    assert SafetensorsFile(path).entries.keys() == load_file(path).keys()


def test_bytes_after_the_last_tensor_are_a_load_error(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt")
    with (ckpt / "model.safetensors").open("ab") as f:
        f.write(bytes(3))
    with pytest.raises(LoadError, match=r"model\.safetensors: 3 bytes after the end of the tensors' data"):
        load_weights(ckpt, **CPU)


def test_a_header_longer_than_the_format_allows(tmp_path: Path) -> None:
    """The official library's limit, 100 MB: a header is read into memory whole (here, a sparse file)."""
    path = tmp_path / "w.safetensors"
    with path.open("wb") as f:
        f.write((100_000_001).to_bytes(8, "little") + b"{")
        f.truncate(8 + 100_000_001)
    with pytest.raises(
        SafetensorsError,
        match=rf"^{path} is not a safetensors file: its header claims 100000001 bytes, more than the 100000000 ",
    ):
        SafetensorsFile(path)


def test_a_header_number_of_5000_digits(tmp_path: Path) -> None:
    """Python's int parser refuses it with a plain ValueError, which escaped load_weights as a traceback."""
    header = '{"t": {"dtype": "F32", "shape": [' + "1" * 5000 + '], "data_offsets": [0, 4]}}'
    path = write_raw(tmp_path / "w.safetensors", header, bytes(4))
    with pytest.raises(
        SafetensorsError, match=r"is not a safetensors file: its header is not JSON \(Exceeds the limit"
    ):
        SafetensorsFile(path)


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [("F32", [2**62, 2**62]), ("F32", [2**40, 2**40, 0]), ("F32", [2**61]), ("U8", [2**61]), ("F32", [2**62] * 3)],
)
def test_a_shape_whose_size_overflows_64_bits(dtype: str, shape: list, tmp_path: Path) -> None:
    """Refused as the official library refuses it: the elements counted dimension by dimension, then the
    bits, each below 2**64 (a hostile shape of a million such dimensions took hours to multiply out)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = write_raw(tmp_path / "w.safetensors", {"t": {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]}})
    with pytest.raises(SafetensorsError, match=r"^.*: tensor 't' of shape \[.*\] is too large: its size overflows 64"):
        SafetensorsFile(path)
    with pytest.raises(SafetensorError, match="overflow computing buffer size"):
        load_file(path)


def test_a_zero_dimension_before_any_overflow_is_an_empty_tensor(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path = write_raw(tmp_path / "w.safetensors", {"t": f32([2**40, 0, 2**40], 0, 0)})
    assert SafetensorsFile(path).read("t").shape == load_file(path)["t"].shape == (2**40, 0, 2**40)


@pytest.mark.parametrize("meta", [[1], "x", 3, {"a": {"b": 1}}, {"a": 1}, {"a": None}])
def test_metadata_must_map_strings_to_strings(meta: object, tmp_path: Path) -> None:
    path = write_raw(tmp_path / "w.safetensors", {"__metadata__": meta, "t": f32([4], 0, 16)}, bytes(16))
    with pytest.raises(SafetensorsError, match=r"the header's __metadata__ must be an object of strings, got "):
        SafetensorsFile(path)


def test_metadata_of_strings_is_read(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "w.safetensors", {"__metadata__": {"format": "pt"}, "t": f32([4], 0, 16)}, bytes(16))
    assert SafetensorsFile(path).metadata == {"format": "pt"}


@pytest.mark.parametrize("dtype", ["F8_E4M3", "f32", "F4"])
def test_an_unsupported_dtype_is_named(dtype: str, tmp_path: Path) -> None:
    path = write_raw(
        tmp_path / "w.safetensors", {"t": {"dtype": dtype, "shape": [4], "data_offsets": [0, 4]}}, bytes(4)
    )
    with pytest.raises(
        SafetensorsError, match=rf"^{path}: tensor 't' has the unsupported dtype \"{dtype}\" \(this reader"
    ):
        SafetensorsFile(path)


LONG = "x" * 1_000_000  # a tensor name of a megabyte


@pytest.mark.parametrize(
    ("header", "body"),
    [
        ({LONG: [1]}, 16),  # malformed entry
        ({LONG: {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}}, 4),  # unsupported dtype
        ({"t": {"dtype": LONG, "shape": [4], "data_offsets": [0, 4]}}, 4),
        ({"t": {"dtype": "F32\nX", "shape": [4], "data_offsets": [0, 16]}}, 16),  # a line break in the dtype
        ({LONG: f32([4.5], 0, 16)}, 16),  # shape
        ({LONG: f32([4], 0, 16.0)}, 16),  # offsets
        ({LONG: f32([4], 0, 8)}, 16),  # size mismatch
        ({LONG: f32([4], 0, 16)}, 8),  # truncated
        ({LONG: f32([4], 0, 16), LONG + "y": f32([4], 0, 16)}, 32),  # invalid offset
    ],
    ids=["entry", "dtype", "long dtype", "line break", "shape", "offsets", "size", "truncated", "offset"],
)
def test_a_hostile_header_gives_one_short_line(header: dict, body: int, tmp_path: Path) -> None:
    path = write_raw(tmp_path / "w.safetensors", header, bytes(body))
    with pytest.raises(SafetensorsError) as info:
        SafetensorsFile(path)
    message = str(info.value)
    assert message.startswith(str(path)) and "\n" not in message and len(message) < len(str(path)) + 400


def test_an_unexpected_tensor_of_a_long_name_gives_one_short_line(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt")
    state = SafetensorsFile(ckpt / "model.safetensors")
    save_file({k: state.read(k) for k in state.entries} | {LONG: torch.zeros(1)}, ckpt / "model.safetensors")
    with pytest.raises(LoadError, match=r"^unexpected tensor 'xxx.*\.\.\. in model\.safetensors: not part of") as info:
        load_weights(ckpt, **CPU)
    assert len(str(info.value)) < 400


def test_a_header_error_is_a_load_error_naming_the_file(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt")
    write_raw(ckpt / "model.safetensors", {"t": f32([4.5], 0, 16)}, bytes(16))
    with pytest.raises(LoadError, match=rf"^{ckpt / 'model.safetensors'}: malformed header entry for tensor 't'"):
        load_weights(ckpt, **CPU)


# --- 4. config.json ------------------------------------------------------------------------------


def test_a_config_nested_too_deeply(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt")
    (ckpt / "config.json").write_text('{"n_layer": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(LoadError, match=r"config\.json is not a GPT-2 config: its JSON is nested too deeply"):
        load_weights(ckpt, **CPU)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_a_number_of_5000_digits_is_not_valid_json(name: str, tmp_path: Path) -> None:
    """Python's int parser refuses more than 4300 digits with a plain ValueError, which escaped as a
    traceback."""
    ckpt = write_checkpoint(tmp_path / "ckpt")
    if name != "config.json":  # the index is read where no model.safetensors is
        (ckpt / "model.safetensors").unlink()
    (ckpt / name).write_text('{"n_layer": ' + "1" * 5000 + "}")
    with pytest.raises(LoadError, match=rf"{re.escape(name)} is not valid JSON: Exceeds the limit"):
        load_weights(ckpt, **CPU)


@pytest.mark.parametrize(("value", "shown"), [("Infinity", "inf"), ("-Infinity", "-inf"), ("1e999", "inf")])
def test_layer_norm_epsilon_must_be_finite(value: str, shown: str, tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt")
    config = (ckpt / "config.json").read_text().replace('"layer_norm_epsilon": 1e-05', f'"layer_norm_epsilon": {value}')
    (ckpt / "config.json").write_text(config)
    with pytest.raises(LoadError, match=rf"layer_norm_epsilon must be (finite|positive), got {shown}"):
        load_weights(ckpt, **CPU)
    with pytest.raises(ConfigError, match=r"layer_norm_epsilon must be finite, got inf"):
        GPTConfig(layer_norm_epsilon=float("inf"))


def test_a_huge_n_layer_fails_fast(tmp_path: Path) -> None:
    """The file holds 2 blocks: the missing ones are counted, not listed (2**31 - 1 blocks' names would never
    fit); an n_layer past any size a config may give is refused by the config itself."""
    ckpt = write_checkpoint(tmp_path / "ckpt")
    for n_layer in (10**6, 2**31 - 1):
        config = json.loads((ckpt / "config.json").read_text()) | {"n_layer": n_layer}
        (ckpt / "config.json").write_text(json.dumps(config))
        start = time.perf_counter()
        with pytest.raises(LoadError) as info:
            load_weights(ckpt, **CPU)
        assert time.perf_counter() - start < 2
        assert str(info.value) == (
            "checkpoint is missing tensor 'h.2.ln_1.weight', 'h.2.ln_1.bias', 'h.2.attn.c_attn.weight', "
            f"'h.2.attn.c_attn.bias', 'h.2.attn.c_proj.weight' and {12 * (n_layer - 2) - 5} more "
            f"(the files hold tensors of 2 of the {n_layer} blocks that n_layer asks for)"
        )
    (ckpt / "config.json").write_text(json.dumps(config | {"n_layer": 10**12}))
    with pytest.raises(LoadError, match=r"config\.json: n_layer must be at most 2147483647, got 1000000000000$"):
        load_weights(ckpt, **CPU)


def test_block_names_beyond_n_layer_are_unexpected(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt")
    st = SafetensorsFile(ckpt / "model.safetensors")
    tensors = {k: st.read(k) for k in st.entries}
    for key in ["transformer.h.2.ln_1.weight", "transformer.h.01.ln_1.weight", "transformer.h." + "9" * 5000 + ".x"]:
        save_file(tensors | {key: torch.zeros(8)}, ckpt / "model.safetensors")
        with pytest.raises(LoadError, match=rf"^unexpected tensor {re.escape(clip(key))} in model\.safetensors"):
            load_weights(ckpt, **CPU)


# --- 5. a torch dtype -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.float8_e4m3fn, torch.complex64])
def test_an_unsupported_torch_dtype(dtype: torch.dtype, tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt")
    refused = rf"^unsupported dtype {dtype}; use torch\.float32, torch\.float64, torch\.float16 or torch\."
    with pytest.raises(LoadError, match=refused):
        load_weights(ckpt, dtype=dtype, **CPU)


@pytest.mark.parametrize("dtype", [3, None, ["float32"]])
def test_a_dtype_that_is_neither_a_name_nor_a_torch_dtype(dtype: object, tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt")
    with pytest.raises(
        LoadError, match=r"^dtype must be a name \(auto, float32, float16, bfloat16 or int8\) or a torch"
    ):
        load_weights(ckpt, dtype=dtype, **CPU)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_a_floating_torch_dtype_is_taken(dtype: torch.dtype, tmp_path: Path) -> None:
    model = load_weights(write_checkpoint(tmp_path / "ckpt"), dtype=dtype, **CPU)
    assert {p.dtype for p in model.parameters()} == {dtype}


# --- 6. a preset with a config.json ----------------------------------------------------------------


def test_a_preset_that_disagrees_with_config_json(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt")
    for source in (ckpt, ckpt / "model.safetensors"):
        with pytest.raises(LoadError) as info:
            load_weights(source, preset_name="distilgpt2", **CPU)
        assert str(info.value) == (
            f"the preset 'distilgpt2' disagrees with {ckpt / 'config.json'} (n_layer 6 against 2, n_head 12 against "
            "2, n_embd 768 against 8, n_positions 1024 against 8, vocab_size 50257 against 16); a preset names the "
            "shape of weights without a config.json: leave it out"
        )


def test_a_preset_without_config_json_gives_the_shape(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt")
    (ckpt / "config.json").unlink()
    with pytest.raises(LoadError, match=r"missing tensor 'h\.2\.ln_1\.weight'.* of 2 of the 6 blocks that n_layer"):
        load_weights(ckpt, preset_name="distilgpt2", **CPU)
