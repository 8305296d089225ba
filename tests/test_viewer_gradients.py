"""The viewer's gradient panels in a real headless Chromium, against a real server (its own process) on the
tiny checkpoint: the gradient-highway charts are drawn with both curves after a run, and attribution
patching draws its heatmaps and the table of sites patched for real, equal to /v1/attribution's answer.
Needs Debian's chromium and playwright; skips without them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serving import served
from test_viewer import CANVAS_INK, chromium, viewer_page

sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
N_LAYER, N_HEAD = 2, 4  # conftest's `tiny`
SCREENSHOT = Path(__file__).resolve().parents[1] / "artifacts" / "viewer_gradients.png"
CLEAN, CORRUPTED = "The cat sat on the mat because it", "The dog sat on the mat because it"


@pytest.fixture(scope="module")
def base_url(tiny: Any, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("viewer_gradients") / "server.log"
    with served(["--model", str(tiny.path), "--tokenizer", str(tokenizer_dir)], log) as url:
        yield url


@pytest.fixture
def page(base_url: str) -> Iterator[Any]:
    with chromium() as browser, viewer_page(browser, base_url) as p:
        yield p


def finished(page: Any, selector: str) -> str:
    page.wait_for_function(
        f"['done', 'error'].includes(document.querySelector('{selector}').dataset.state)", timeout=60_000
    )
    return page.get_attribute(selector, "data-state")


def test_the_highway_charts_after_a_run(page: Any) -> None:
    page.fill("#prompt", CLEAN)
    page.fill("#max-new-tokens", "2")
    page.click("#run")
    assert finished(page, "#grad-status") == "done", page.inner_text("#grad-status")
    assert "First / last layer gradient norm" in page.inner_text("#grad-status")
    charts = page.evaluate(CANVAS_INK, "#grad-panel .grad-charts canvas")
    assert len(charts) == 2
    for chart in charts:  # both curves: with (blue) and without (orange) residual connections
        assert chart["ink"] > 0.02 and chart["blue"] > 50 and chart["orange"] > 50, chart
    assert "with residual connections" in page.get_attribute("#chart-grad", "aria-label")


def test_attribution_heatmaps_and_the_patched_sites(page: Any, base_url: str) -> None:
    page.fill("#prompt", CLEAN)
    page.fill("#max-new-tokens", "2")
    page.click("#run")
    finished(page, "#grad-status")
    page.fill("#attr-clean", CLEAN)
    page.fill("#attr-corrupted", CORRUPTED)
    page.fill("#attr-verify", "4")
    page.click("#attr-run")
    assert finished(page, "#attr-status") == "done", page.inner_text("#attr-status")
    metric = {"type": "logit_diff", "tokens": [" was", " is"]}
    body = {"clean": CLEAN, "corrupted": CORRUPTED, "metric": metric, "verify": 4}
    want = httpx.post(base_url + "/v1/attribution", json=body, timeout=60).json()
    maps = page.evaluate(CANVAS_INK, "#grad-panel canvas.attr-map")
    cells = [int(c) for c in page.eval_on_selector_all("canvas.attr-map", "cs => cs.map(c => c.dataset.cells)")]
    assert cells == [N_LAYER * len(want["clean"]["tokens"]), N_LAYER * N_HEAD, N_LAYER * 2]
    assert all(m["ink"] > 0.05 and m["colours"] > 5 for m in maps), maps
    rows = page.locator("#attr-verified tbody tr")
    assert rows.count() == 4
    for i, v in enumerate(want["verified"]):
        assert rows.nth(i).locator("td").first.inner_text().startswith(v["site"]["hook"])
    SCREENSHOT.parent.mkdir(exist_ok=True)
    page.locator("#grad-panel").screenshot(path=str(SCREENSHOT))
    # a refused request says why in the panel, and leaves nothing of the earlier prompts' attribution
    page.fill("#attr-corrupted", "The dog")
    page.click("#attr-run")
    assert finished(page, "#attr-status") == "error"
    assert "same length" in page.inner_text("#attr-status")
    assert all(m["ink"] == 0 for m in page.evaluate(CANVAS_INK, "#grad-panel canvas.attr-map"))
    assert page.locator("#attr-verified tr").count() == 0
    page.set_viewport_size({"width": 1000, "height": 800})  # a resize draws nothing back
    page.wait_for_timeout(300)
    assert all(m["ink"] == 0 for m in page.evaluate(CANVAS_INK, "#grad-panel canvas.attr-map"))


def test_the_gradient_panels_wait_for_a_loading_model(page: Any) -> None:
    """A run pressed while the server still loads its model: the highway and attribution wait as the page's
    run does, then draw (they once reported the 503 while the page said "Done")."""
    loading: dict[str, int] = {}

    def still_loading(route: Any) -> None:
        path = route.request.url.rsplit("/", 1)[-1]
        if loading.get(path, 0) < 2:
            loading[path] = loading.get(path, 0) + 1
            body = {"error": {"type": "service_unavailable", "message": "the model is still loading; retry shortly"}}
            route.fulfill(status=503, content_type="application/json", body=json.dumps(body))
        else:
            route.continue_()

    page.route("**/v1/analyze", still_loading)
    page.route("**/v1/attribution", still_loading)
    page.fill("#prompt", CLEAN)
    page.fill("#max-new-tokens", "2")
    page.click("#run")
    page.wait_for_function("document.querySelector('#grad-status').textContent.includes('Waiting for the model')")
    assert finished(page, "#grad-status") == "done", page.inner_text("#grad-status")
    assert all(c["ink"] > 0.02 for c in page.evaluate(CANVAS_INK, "#grad-panel .grad-charts canvas"))
    page.fill("#attr-clean", CLEAN)
    page.fill("#attr-corrupted", CORRUPTED)
    page.click("#attr-run")
    assert finished(page, "#attr-status") == "done", page.inner_text("#attr-status")
    assert loading == {"analyze": 2, "attribution": 2}


def test_a_failed_highway_leaves_no_old_charts_even_after_a_resize(page: Any) -> None:
    page.fill("#prompt", CLEAN)
    page.fill("#max-new-tokens", "2")
    page.click("#run")
    assert finished(page, "#grad-status") == "done", page.inner_text("#grad-status")
    # a 1-token prompt: the highway is refused (400); the previous prompt's charts are gone, not kept
    page.fill("#prompt", "a")
    page.click("#run")
    assert finished(page, "#grad-status") == "error"
    refusal = page.inner_text("#grad-status")
    assert "at least 2 tokens" in refusal
    blank = [c["ink"] == 0 for c in page.evaluate(CANVAS_INK, "#grad-panel .grad-charts canvas")]
    assert blank == [True, True]
    # a resize redraws what there is to draw: nothing here, and the error stays
    page.set_viewport_size({"width": 1000, "height": 800})
    page.wait_for_timeout(500)
    assert page.inner_text("#grad-status") == refusal
    assert page.get_attribute("#grad-status", "data-state") == "error"
    assert all(c["ink"] == 0 for c in page.evaluate(CANVAS_INK, "#grad-panel .grad-charts canvas"))


def test_a_token_box_holds_text_or_a_hash_id(page: Any) -> None:
    """ " 2" is the token " 2" (its text, leading space and all), not the id 2; "#362" is the id 362."""
    page.select_option("#attr-metric", "logit_diff")
    page.fill("#attr-clean", CLEAN)
    page.fill("#attr-corrupted", CORRUPTED)
    for a, b, want in ((" 2", "3", [" 2", "3"]), ("#362", " #5", [362, " #5"])):
        page.fill("#attr-token-a", a)
        page.fill("#attr-token-b", b)
        with page.expect_request(lambda r: r.url.endswith("/v1/attribution")) as sent:
            page.click("#attr-run")
        assert sent.value.post_data_json["metric"]["tokens"] == want
        finished(page, "#attr-status")
