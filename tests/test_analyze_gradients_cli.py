"""gpt2-analyze --gradients and --attribution, run as a user runs them (a subprocess) on the tiny checkpoint
with the real tokenizer: the tables equal the model-level functions, the plots are written, and bad input
is a one-line error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Checkpoint, load_ours
from test_analyze_cli import gpt2_analyze

from model.interventions import EditSpec
from model.lab.attribution import attribution
from model.lab.gradients import LogitDiff, highway

CLEAN, CORRUPTED = "The cat sat on the mat because it", "The dog sat on the mat because it"
CLEAN_IDS = [464, 3797, 3332, 319, 262, 2603, 780, 340]
CORRUPTED_IDS = [464, 3290, 3332, 319, 262, 2603, 780, 340]


@pytest.fixture(scope="module")
def model_args(tiny: Checkpoint, tokenizer_dir: Path) -> list[str]:
    return ["--model", str(tiny.path), "--tokenizer", str(tokenizer_dir), "--device", "cpu"]


def test_gradients_table_and_plot(model_args: list[str], tiny: Checkpoint, tmp_path: Path) -> None:
    png = tmp_path / "highway.png"
    r = gpt2_analyze(CLEAN, *model_args, "--gradients", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "gradient, with residual connections" in line)
    columns = ["grad_norm", "jac_rms", "|J-I|_rms"]
    assert lines[start + 1].split() == ["layer", *columns, "|", *columns]
    rows = [line.split() for line in lines[start + 2 : start + 5]]
    model = load_ours(tiny)
    every = (0, 1)
    want = highway(model, CLEAN_IDS), highway(model, CLEAN_IDS, EditSpec((), every, every))
    for row, with_skips, without in zip(rows, *want, strict=True):
        assert int(row[0]) == with_skips.layer
        assert float(row[1]) == pytest.approx(with_skips.grad_norm, rel=1e-3)
        assert row[4] == "|" and float(row[5]) == pytest.approx(without.grad_norm, rel=1e-3)
        if with_skips.jacobian_norm is None:
            assert row[2] == row[3] == "-"
        else:
            assert float(row[2]) == pytest.approx(with_skips.jacobian_norm, abs=2e-3)
            assert float(row[7]) == pytest.approx(without.jacobian_identity_distance, abs=2e-3)
    ratio = want[0][0].grad_norm / want[0][-1].grad_norm
    assert f"first / last layer gradient norm: {ratio:.3g} with the skips" in lines[start + 5]
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and png.stat().st_size > 10_000


def test_attribution_tables_and_plot(model_args: list[str], tiny: Checkpoint, tmp_path: Path) -> None:
    png = tmp_path / "attribution.png"
    metric = json.dumps({"type": "logit_diff", "tokens": [" was", 318]})
    r = gpt2_analyze("--attribution", CLEAN, CORRUPTED, "--metric", metric, "--verify", "2", *model_args,
                     "--plot", str(png))  # fmt: skip
    assert r.returncode == 0, r.stderr
    want = attribution(load_ours(tiny), CLEAN_IDS, CORRUPTED_IDS, LogitDiff((373, 318)), 2)
    out = r.stdout
    assert f"clean {want.clean_metric:.4f}, corrupted {want.corrupted_metric:.4f}" in out
    lines = out.splitlines()
    first = lines.index("attribution at blocks.L.hook_resid_pre, per position (clean token / corrupted token):")
    assert "' cat'/' dog'" in lines[first + 1]
    for layer in range(2):
        cells = [float(v) for v in lines[first + 2 + layer].split()[1:]]
        assert cells == pytest.approx(want.resid_pre[layer].tolist(), abs=1e-4)
    patched = lines[lines.index(next(x for x in lines if x.startswith("patched for real"))) + 1 :]
    assert len(patched) == 2
    for line, v in zip(patched, want.verified, strict=True):
        assert line.startswith(v.site.hook)
        assert [float(x) for x in line.split()[-2:]] == pytest.approx([v.attribution, v.patched_change], abs=1e-4)
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_attribution_table_shows_no_negative_zero() -> None:
    """Values that round to 0 at 4 digits are shown as 0.0000 in every column, the patched sites' too."""
    import torch
    from gpt2_scripts.analyze import attribution_table

    from model.lab.attribution import Attribution, Site, Verified

    tiny = -3e-6
    result = Attribution(
        clean_metric=tiny, corrupted_metric=0.0, resid_pre=torch.full((1, 1), tiny), z=torch.full((1, 2), tiny),
        attn_out=torch.full((1,), tiny), mlp_out=torch.full((1,), tiny),
        verified=[Verified(Site("blocks.0.hook_resid_pre", 0, None), tiny, tiny, tiny)],
    )  # fmt: skip
    table = attribution_table(result, ["a"], ["b"])
    assert "-0.0000" not in table and "0.0000" in table, table


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--attribution", CLEAN, "The dog", "--metric", "loss"], "same length"),
        (["--attribution", CLEAN, CORRUPTED, "--metric", '{"type": "kl"}'], "--metric"),
        (["--attribution", CLEAN, CORRUPTED, "--metric", '{"type": "loss", "type": "logprob"}'], "key 'type' more"),
        (  # the path in the flag's own value, not pydantic's logprob.token
            ["--attribution", CLEAN, CORRUPTED, "--metric", '{"type": "logprob"}'],
            """'{"type": "logprob"}'): token: Field required""",
        ),
        (["Hi", "--gradients"], "at least 2 tokens"),
    ],
    ids=["lengths", "metric-type", "metric-key-twice", "metric-field", "one-token"],
)
def test_bad_input_is_one_line(model_args: list[str], args: list[str], message: str) -> None:
    r = gpt2_analyze(*args, *model_args)
    assert r.returncode == 1, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpt2-analyze: error:") and message in lines[0], r.stderr
