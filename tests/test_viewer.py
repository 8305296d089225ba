"""The viewer page (server/static) in a real headless Chromium, against a real server on a tiny checkpoint.

The page is driven as a user would drive it: type a prompt, press Run, read what it drew. Rendering is
checked in the browser itself: canvases are read back pixel by pixel (non-blank, and the two series'
colours present in each chart), the logit-lens table has one row per layer plus the embeddings, and the
heatmap covers prompt and generated positions. A screenshot is saved to artifacts/viewer.png.

Needs Debian's chromium (/usr/bin/chromium) and the `playwright` Python package; skips without them.
Playwright's own browser download is never used.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from serving import served

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.is_file():
    pytest.skip(
        f"no Chromium at {CHROMIUM}: install Debian's chromium (apt-get install chromium) to test the viewer",
        allow_module_level=True,
    )
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="the playwright package is not installed (pip install playwright)"
)

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "artifacts" / "viewer.png"
API_KEY = "viewer-test-key"
N_LAYER, N_HEAD = 2, 4  # conftest's `tiny`
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# Per canvas: its size, the share of non-white pixels, how many distinct colours, and how many pixels are
# close to each series colour of the residual charts (blue: with residual connections, orange: without).
CANVAS_INK = """
(selector) => Array.from(document.querySelectorAll(selector)).map((c) => {
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  const near = (i, r, g, b) => Math.abs(d[i] - r) + Math.abs(d[i + 1] - g) + Math.abs(d[i + 2] - b) < 40;
  const colours = new Set();
  let ink = 0, blue = 0, orange = 0;
  for (let i = 0; i < d.length; i += 4) {
    if (d[i] !== 255 || d[i + 1] !== 255 || d[i + 2] !== 255) ink++;
    if (colours.size < 1000) colours.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]);
    if (near(i, 31, 95, 168)) blue++;
    if (near(i, 208, 89, 11)) orange++;
  }
  const n = d.length / 4;
  return {width: c.width, height: c.height, ink: ink / n, colours: colours.size, blue, orange,
          positions: Number(c.dataset.positions || 0)};
})
"""


@pytest.fixture(scope="module")
def base_url(tiny: Any, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real server (its own process) on the tiny checkpoint, requiring an API key."""
    log = tmp_path_factory.mktemp("viewer") / "server.log"
    with served(["--model", str(tiny.path), "--tokenizer", str(tokenizer_dir), "--api-key", API_KEY], log) as url:
        yield url


@contextmanager
def chromium() -> Iterator[Any]:
    """Debian's headless Chromium, driven by playwright."""
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@contextmanager
def viewer_page(browser: Any, base_url: str) -> Iterator[Any]:
    """The viewer, opened fresh; fails the test on any uncaught JavaScript error."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    js_errors: list[str] = []
    page.on("pageerror", lambda e: js_errors.append(str(e)))
    page.goto(base_url + "/")
    yield page
    context.close()
    assert not js_errors, f"JavaScript errors in the page: {js_errors}"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


@pytest.fixture
def page(browser: Any, base_url: str) -> Iterator[Any]:
    with viewer_page(browser, base_url) as p:
        yield p


def run_prompt(page: Any, prompt: str, max_new_tokens: int, key: str | None = API_KEY) -> str:
    """Fill the form, press Run, wait until the page says it has finished; its final state."""
    page.fill("#prompt", prompt)
    page.fill("#max-new-tokens", str(max_new_tokens))
    page.fill("#temperature", "0")
    if key is not None:
        page.fill("#api-key", key)
    page.click("#run")
    page.wait_for_function(
        "['done', 'error'].includes(document.querySelector('#status').dataset.state)", timeout=60_000
    )
    return page.get_attribute("#status", "data-state")


def test_viewer_renders_a_run(page: Any) -> None:
    # Without the key, the page shows the server's 401 message instead of failing silently.
    page.wait_for_selector("#errors:not([hidden])")
    assert "missing API key" in page.inner_text("#errors")

    state = run_prompt(page, "The cat sat on the mat because it was", max_new_tokens=8)
    assert state == "done", page.inner_text("#errors")
    assert page.is_hidden("#errors")
    assert f"{N_LAYER} layers" in page.inner_text("#model-info")

    assert page.inner_text("#generated-text").strip(), "no generated text"
    meta = page.inner_text("#output-meta")
    n_prompt, n_generated = map(int, re.search(r"(\d+) prompt tokens, (\d+) generated", meta).groups())
    assert 1 <= n_generated <= 8, meta

    # Logit lens: one row per layer plus the embeddings, one column per prompt position.
    rows = page.locator("#lens-table tbody tr")
    assert rows.count() == N_LAYER + 1
    assert page.locator("#lens-table tbody tr:first-child td").count() == n_prompt
    assert page.inner_text("#lens-table tbody tr:first-child th") == "emb"
    assert re.fullmatch(r"\d\.\d\d", page.inner_text("#lens-table tbody tr:last-child td .prob"))
    page.check('input[name="lens-run"][value="ablated"]')
    assert "without residual connections" in page.inner_text("#lens-table caption")
    assert page.locator("#lens-table tbody tr").count() == N_LAYER + 1
    page.check('input[name="lens-run"][value="layers"]')

    # One head's heatmap over prompt and generated positions, drawn (many colours, mostly inked).
    (heatmap,) = page.evaluate(CANVAS_INK, "#attn-view canvas.heatmap")
    assert heatmap["positions"] == n_prompt + n_generated
    assert heatmap["ink"] > 0.3 and heatmap["colours"] > 20, heatmap

    # The four residual-stream charts, each with both curves.
    charts = page.evaluate(CANVAS_INK, ".charts canvas")
    assert len(charts) == 4
    for chart in charts:
        assert chart["ink"] > 0.02 and chart["blue"] > 50 and chart["orange"] > 50, chart
    assert page.locator("#resid-table tbody tr").count() == N_LAYER + 1

    SCREENSHOT.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)

    # The grid: every head of the chosen layer; clicking one opens it alone.
    page.select_option("#attn-layer", str(N_LAYER - 1))
    page.check('input[name="attn-view"][value="grid"]')
    grid = page.evaluate(CANVAS_INK, "#attn-view canvas.heatmap")
    assert len(grid) == N_HEAD
    assert all(h["ink"] > 0.2 and h["positions"] == n_prompt + n_generated for h in grid), grid
    page.locator("#attn-view canvas.heatmap").nth(2).click()
    assert page.input_value("#attn-head") == "2"
    assert page.locator("#attn-view canvas.heatmap").count() == 1


def test_viewer_shows_api_errors(page: Any) -> None:
    # /v1/generate refuses the request (past the context, and the server's cap); /v1/analyze still answers and
    # is drawn.
    state = run_prompt(page, "Hello there", max_new_tokens=100_000)
    assert state == "error"
    errors = page.inner_text("#errors")
    assert "/v1/generate failed (400" in errors
    assert "max_new_tokens (100000) leaves no room for a prompt in the context" in errors
    assert page.locator("#lens-table tbody tr").count() == N_LAYER + 1
