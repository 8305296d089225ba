"""The viewer's SAE panel in a real headless Chromium, against a real server (its own process) on the tiny
checkpoint with a random SAE: the per-token feature table equals /v1/features, and the steering control
(a clicked feature, the strength slider) shows the steered text beside the unsteered one, each equal to
/v1/generate's answer for the same request. Needs Debian's chromium and playwright; skips without them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sae_files import write_sae
from serving import served
from test_viewer import chromium, viewer_page

sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
HOOK = "blocks.1.hook_resid_pre"
OTHER_HOOK = "blocks.0.hook_resid_pre"
PROMPT = "The cat sat on the mat"


@pytest.fixture(scope="module")
def base_url(tiny: Any, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("viewer_sae")
    sae = write_sae(root / "sae", hook=HOOK, d_in=64, d_sae=256, seed=9)
    other = write_sae(root / "other", hook=OTHER_HOOK, d_in=64, d_sae=16, seed=10)
    args = ["--model", str(tiny.path), "--tokenizer", str(tokenizer_dir), "--sae", f"s={sae}", "--sae", f"t={other}"]
    with served(args, root / "server.log") as url:
        yield url


@pytest.fixture
def page(base_url: str) -> Iterator[Any]:
    with chromium() as browser, viewer_page(browser, base_url) as p:
        yield p


def test_feature_panel_and_steering(page: Any, base_url: str) -> None:
    page.wait_for_selector("#sae-panel:not([hidden])")
    page.fill("#prompt", PROMPT)
    page.fill("#max-new-tokens", "8")
    page.fill("#sae-top-k", "3")
    page.click("#sae-run")
    want = httpx.post(base_url + "/v1/features", json={"prompt": PROMPT, "sae": "s", "top_k": 3}, timeout=60).json()
    rows = page.locator("#sae-table tbody tr")
    rows.nth(len(want["tokens"]) - 1).wait_for()
    assert rows.count() == len(want["tokens"])
    for i, row in enumerate(want["features"]):
        shown = rows.nth(i).locator("button.feature")
        assert [shown.nth(j).get_attribute("data-feature") for j in range(shown.count())] == [
            str(f["id"]) for f in row["features"]
        ]
    # a feature clicked, then the strength slider moved: steered and unsteered side by side
    feature = want["features"][-1]["features"][0]["id"]
    rows.nth(len(want["tokens"]) - 1).locator("button.feature").first.click()
    assert page.input_value("#steer-feature") == str(feature) and page.input_value("#steer-hook") == HOOK
    page.evaluate("() => { const s = document.querySelector('#steer-strength'); s.value = '60';"
                  " s.dispatchEvent(new Event('input')); }")  # fmt: skip
    body = {"prompt": PROMPT, "max_new_tokens": 8, "temperature": 0}
    edit = {"hook": HOOK, "op": "steer", "scale": 60, "direction": {"sae": "s", "feature": feature}}
    plain = httpx.post(base_url + "/v1/generate", json=body, timeout=60).json()["choices"][0]["text"]
    steered = httpx.post(base_url + "/v1/generate", json=body | {"interventions": [edit]}, timeout=60).json()
    steered_text = steered["choices"][0]["text"]
    page.wait_for_function(
        "(t) => document.querySelector('#steer-steered').textContent === t", arg=PROMPT + steered_text, timeout=60_000
    )
    assert page.inner_text("#steer-plain") == PROMPT + plain
    assert steered_text != plain


def test_a_run_keeps_the_sae_chosen(page: Any) -> None:
    """Each run fills the SAE panel again (with the API key, if one is needed): the SAE chosen stays chosen,
    so a steer names the SAE whose hook it edits."""
    page.wait_for_selector("#sae-panel:not([hidden])")
    assert page.input_value("#sae-select") == "s"
    page.select_option("#sae-select", "t")
    page.fill("#prompt", PROMPT)
    page.fill("#max-new-tokens", "2")
    with page.expect_response(lambda r: r.url.endswith("/v1/model")):
        page.click("#run")
    page.wait_for_timeout(200)
    assert page.input_value("#sae-select") == "t"


def test_choosing_an_sae_points_the_steer_at_its_hook(page: Any) -> None:
    """A steer names the SAE chosen at that SAE's own hook (it once kept the first SAE's hook)."""
    page.wait_for_selector("#sae-panel:not([hidden])")
    page.select_option("#sae-select", "t")
    assert page.input_value("#steer-hook") == OTHER_HOOK
    page.select_option("#sae-select", "s")
    assert page.input_value("#steer-hook") == HOOK


def test_a_slow_feature_answer_never_replaces_a_newer_one(page: Any) -> None:
    """The first prompt's features, held back until the second prompt's are shown, are dropped (and the
    request aborted); a run of the page clears the table and its status line."""
    held: list[Any] = []

    def hold_the_first(route: Any) -> None:
        if not held:
            held.append(route)
        else:
            route.continue_()

    page.route("**/v1/features", hold_the_first)
    page.wait_for_selector("#sae-panel:not([hidden])")
    page.fill("#prompt", PROMPT)
    page.click("#sae-run")
    while not held:
        page.wait_for_timeout(50)
    page.fill("#prompt", "Second")
    page.click("#sae-run")
    page.wait_for_function("document.querySelector('#sae-status').textContent.startsWith('1 tokens')")
    with contextlib.suppress(sync_api.Error):  # aborted already
        held[0].continue_()
    page.wait_for_timeout(500)
    assert page.locator("#sae-table tbody tr").count() == 1
    assert page.inner_text("#sae-status").startswith("1 tokens")
    page.fill("#max-new-tokens", "2")
    page.click("#run")
    page.wait_for_function("document.querySelector('#status').dataset.state === 'done'", timeout=60_000)
    assert page.locator("#sae-table tbody tr").count() == 0 and page.inner_text("#sae-status") == ""


def test_a_failed_steer_leaves_no_earlier_comparison(page: Any) -> None:
    page.wait_for_selector("#sae-panel:not([hidden])")
    page.fill("#prompt", PROMPT)
    page.fill("#max-new-tokens", "2")
    page.click("#steer-run")
    page.wait_for_function("document.querySelector('#steer-plain').textContent.startsWith('The cat')")
    page.fill("#steer-hook", "blocks.9.hook_resid_pre")  # the tiny model has 2 layers
    page.click("#steer-run")
    page.wait_for_function("document.querySelector('#steer-steered').textContent.includes('failed (400')")
    assert page.inner_text("#steer-plain") == ""
