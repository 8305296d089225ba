"""The viewer page (server/static) in a real headless Chromium, against a real server on a tiny checkpoint.

The page is driven as a user would drive it: type a prompt, press Run, read what it drew. Rendering is
checked in the browser itself: canvases are read back pixel by pixel (non-blank, and the two series'
colours present in each chart), the logit-lens table has one row per layer plus the embeddings, and the
heatmap covers prompt and generated positions. A screenshot is saved to artifacts/viewer.png.

Needs Debian's chromium (/usr/bin/chromium) and the `playwright` Python package; skips without them.
Playwright's own browser download is never used.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
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
# Small enough that all layers' attention patterns of LONG_PROMPT as JSON (25 bytes a number) are refused,
# large enough for one layer's as float32 (the viewer fetches a layer at a time).
MAX_ACTIVATION_BYTES = 1_000_000
LONG_PROMPT = "cat" + " cat" * 99  # 100 tokens
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
    args = ["--model", str(tiny.path), "--tokenizer", str(tokenizer_dir), "--api-key", API_KEY]
    with served([*args, "--max-activation-bytes", str(MAX_ACTIVATION_BYTES)], log) as url:
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
    # a test's routes go first, waiting for none of their handlers: one that fetched after the context closed
    # (the page asks /v1/model again) raised in the next test's setup, "Request context disposed"
    page.unroute_all(behavior="ignoreErrors")
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
    # by keyboard: Enter on a tile opens it, and the focus moves to the heatmap that replaced the grid
    page.check('input[name="attn-view"][value="grid"]')
    page.locator("#attn-view canvas.heatmap").nth(1).focus()
    page.keyboard.press("Enter")
    page.wait_for_function("document.activeElement.matches('#attn-view canvas.heatmap')")
    assert page.input_value("#attn-head") == "1" and page.locator("#attn-view canvas.heatmap").count() == 1


def test_an_int8_model_is_shown_as_one(page: Any) -> None:
    """/v1/model's dtype is the activations' (float32 for an int8 model): the page names the weights too."""

    def as_int8(route: Any) -> None:
        answer = route.fetch(headers={**route.request.headers, "authorization": f"Bearer {API_KEY}"})
        body = answer.json() | {"weights": "int8", "quantization": "weight-only int8: ..."}
        route.fulfill(response=answer, json=body)

    page.route("**/v1/model", as_int8)
    page.reload()
    page.wait_for_function("document.querySelector('#model-info').textContent.includes('layers')")
    assert "int8 weights, float32 activations on cpu" in page.inner_text("#model-info")
    assert page.get_attribute("#model-info", "title") == "weight-only int8: ..."


def test_the_analysis_over_the_dump_cap_says_what_the_page_asked_for(page: Any) -> None:
    def too_big(route: Any) -> None:
        body = {"error": {"type": "invalid_request_error", "message": "over --max-activation-bytes: ask for less"}}
        route.fulfill(status=413, content_type="application/json", body=json.dumps(body))

    page.route("**/v1/analyze", too_big)
    assert run_prompt(page, "Hello", max_new_tokens=2) == "error"
    assert "ask for less (this page asks for the lens's top 5 tokens" in page.inner_text("#errors")


def test_the_pages_copy_under_static_sends_to_the_page(browser: Any, base_url: str) -> None:
    with viewer_page(browser, base_url) as page:
        page.goto(base_url + "/static/index.html")
        assert page.url == base_url + "/"
        page.wait_for_selector("#errors:not([hidden])")  # the page's own first call ran (its 401: no key yet)
        assert "missing API key" in page.inner_text("#errors")


def test_viewer_shows_api_errors(page: Any) -> None:
    # /v1/generate refuses the request (past the context, and the server's cap); /v1/analyze still answers and
    # is drawn.
    state = run_prompt(page, "Hello there", max_new_tokens=100_000)
    assert state == "error"
    errors = page.inner_text("#errors")
    assert "/v1/generate failed (400" in errors
    assert "max_new_tokens (100000) leaves no room for a prompt in the context" in errors
    assert page.locator("#lens-table tbody tr").count() == N_LAYER + 1


def finished(page: Any) -> str:
    page.wait_for_function(
        "['done', 'error'].includes(document.querySelector('#status').dataset.state)", timeout=60_000
    )
    return page.get_attribute("#status", "data-state")


def lens_columns(page: Any) -> int:
    return page.locator("#lens-table tbody tr:first-child td").count()


def test_a_failed_generation_leaves_nothing_of_the_previous_prompt(page: Any) -> None:
    assert run_prompt(page, "The cat sat on the mat because it was", max_new_tokens=4) == "done"
    assert page.inner_text("#generated-text") and page.locator("#attn-view canvas.heatmap").count() == 1
    # /v1/generate answers 500, then the connection drops; /v1/analyze still answers for the new prompt
    page.route(
        "**/v1/generate",
        lambda route: route.fulfill(
            status=500,
            content_type="application/json",
            body=json.dumps({"error": {"type": "internal_error", "message": "the test broke it"}}),
        ),
    )
    for prompt, message in [("Hello there", "the test broke it"), ("Good morning to you", "cannot reach the server")]:
        if message == "cannot reach the server":
            page.unroute("**/v1/generate")
            page.route("**/v1/generate", lambda route: route.abort())
        assert run_prompt(page, prompt, max_new_tokens=4) == "error"
        assert message in page.inner_text("#errors")
        # no text, meta line or heatmap of the earlier prompt: the attention panel says why it is empty
        assert page.inner_text("#prompt-echo") == "" and page.inner_text("#generated-text") == ""
        assert page.inner_text("#output-meta") == ""
        assert page.locator("#attn-view canvas").count() == 0
        assert "the generation failed" in page.inner_text("#attn-view")
        assert page.is_disabled("#attn-layer")
        # the lens is the new prompt's
        tokens = page.locator("#lens-table thead th .tok").all_inner_texts()
        assert "".join(tokens).replace("␣", " ") == prompt


def test_a_new_run_supersedes_the_one_in_flight(page: Any) -> None:
    held: list[Any] = []  # the first run's /v1/generate, answered only after the second run has finished
    aborted: list[str] = []
    page.on("requestfailed", lambda r: aborted.append(r.url) if r.url.endswith("/v1/generate") else None)
    page.route("**/v1/generate", lambda route: held.append(route) if not held else route.continue_())
    page.fill("#api-key", API_KEY)
    page.fill("#max-new-tokens", "4")
    page.fill("#temperature", "0")
    page.fill("#prompt", "The first prompt, which is slow")
    page.click("#run")
    page.wait_for_function("document.querySelector('#status').dataset.state === 'running'")
    while not held:
        page.wait_for_timeout(50)
    assert page.is_disabled("#run")
    # Ctrl+Enter during the run starts a new one, which supersedes the first
    page.fill("#prompt", "A second prompt")
    page.press("#prompt", "Control+Enter")
    assert finished(page) == "done", page.inner_text("#errors")
    assert aborted, "the superseded run's /v1/generate was not aborted"
    with contextlib.suppress(sync_api.Error):  # playwright may refuse to go on with an aborted request
        held[0].continue_()  # too late: its answer, if it comes, must change nothing
    page.wait_for_timeout(1000)
    assert page.get_attribute("#status", "data-state") == "done" and page.is_hidden("#errors")
    assert page.inner_text("#prompt-echo") == "A second prompt"
    n_prompt, n_generated = map(
        int, re.search(r"(\d+) prompt tokens, (\d+) generated", page.inner_text("#output-meta")).groups()
    )
    assert lens_columns(page) == n_prompt == 3
    (heatmap,) = page.evaluate(CANVAS_INK, "#attn-view canvas.heatmap")
    assert heatmap["positions"] == n_prompt + n_generated
    assert page.is_enabled("#run")


def test_the_viewer_under_a_path_prefix(browser: Any, base_url: str) -> None:
    """Served at /gpt2/ (a proxy or Ray Serve route prefix that strips it): every file and API call goes
    under /gpt2/, none to the root."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    outside: list[str] = []

    def proxy(route: Any) -> None:
        path = route.request.url[len(base_url) :]
        if not path.startswith("/gpt2/"):
            outside.append(path)
            route.fulfill(status=404, body="not under the prefix")
            return
        route.fulfill(response=route.fetch(url=base_url + path[len("/gpt2") :]))

    context.route(base_url + "/**", proxy)
    page = context.new_page()
    js_errors: list[str] = []
    page.on("pageerror", lambda e: js_errors.append(str(e)))
    try:
        page.goto(base_url + "/gpt2/")
        assert outside == []  # the page's own files: under the prefix
        page.wait_for_selector("#errors:not([hidden])")  # the 401 without the key: app.js runs, and asked
        assert run_prompt(page, "The cat sat on the mat", max_new_tokens=4) == "done", page.inner_text("#errors")
        assert page.locator("#attn-view canvas.heatmap").count() == 1
        assert page.locator("#lens-table tbody tr").count() == N_LAYER + 1
        assert outside == [] and not js_errors
        # the highway's analysis is still on its way: let it end before the context goes
        page.wait_for_function("['done', 'error'].includes(document.querySelector('#grad-status').dataset.state)")
    finally:
        context.unroute_all(behavior="ignoreErrors")
        context.close()


def test_invisible_characters_in_tokens_are_labelled(page: Any, base_url: str) -> None:
    # GPT-2 has one token each for BEL, the zero-width space, the no-break space and the left-to-right mark
    prompt = "a\x07b\u200bc\u00a0d\u200e"
    assert run_prompt(page, prompt, max_new_tokens=2) == "done", page.inner_text("#errors")
    headers = page.locator("#lens-table thead th .tok").all_inner_texts()
    assert headers == ["a", "\\x07", "b", "\\u200b", "c", "⍽", "d", "\\u200e"]
    ids = httpx.post(
        base_url + "/tokenize", json={"prompt": prompt}, headers={"Authorization": f"Bearer {API_KEY}"}
    ).json()["tokens"]
    titles = page.locator("#lens-table thead th[title]").evaluate_all("ths => ths.map(th => th.title)")
    assert [re.search(r"\(id (\d+)\)", t).group(1) for t in titles] == [str(i) for i in ids]
    assert f"id {ids[1]}" in page.get_attribute("#lens-table tbody tr td:nth-of-type(2)", "title")
    # the heatmap's tooltip names each position's token id
    heatmap = page.locator("#attn-view canvas.heatmap")
    heatmap.scroll_into_view_if_needed()
    box = heatmap.bounding_box()
    for fx in range(1, 20):
        page.mouse.move(box["x"] + box["width"] * fx / 20, box["y"] + box["height"] * 0.6)
        if page.is_visible("#attn-tooltip"):
            break
    tip = page.inner_text("#attn-tooltip")
    assert re.search(r"query \d+ “.*” \(id \d+\) → key \d+ “.*” \(id \d+\): weight", tip), tip


def test_a_seed_beyond_exact_numbers_is_refused_in_the_page(page: Any) -> None:
    sent: list[str] = []
    page.on("request", lambda r: sent.append(r.url) if "/v1/generate" in r.url or "/v1/analyze" in r.url else None)
    page.fill("#api-key", API_KEY)
    for seed in ["9223372036854775807", "9007199254740993", "-9007199254740992"]:
        page.fill("#seed", seed)
        assert run_prompt(page, "Hello", max_new_tokens=2) == "error"
        errors = page.inner_text("#errors")
        assert f"the seed {seed} is too large" in errors, errors
        assert page.get_attribute("#grad-status", "data-state") == "error"  # the highway not measured either
        # the attention panel says why it stays empty (it once waited "for the generation" for ever)
        assert "the run was refused" in page.inner_text("#attn-view")
    page.evaluate("() => { document.querySelector('#seed').type = 'text'; }")  # takes what a number field refuses
    for seed in ["1.5", "1.0000000000000001", "1e-3", "x", "."]:
        page.fill("#seed", seed)
        assert run_prompt(page, "Hello", max_new_tokens=2) == "error"
        assert f"the seed must be a whole number, not “{seed}”" in page.inner_text("#errors")
    assert sent == []
    # what the number field takes as a whole number is one: 1e3 is 1000, 7.0 is 7
    seeds = page.evaluate("() => ['1e3', '7.0', '-20e-1', '0.042e5', '+5', '1e400'].map((s) => {"
                          " try { return parseSeed(s); } catch (e) { return e.message; } })")  # fmt: skip
    assert seeds[:5] == [1000, 7, -2, 4200, 5] and "too large" in seeds[5], seeds
    page.fill("#seed", "9007199254740991")  # 2^53 - 1: sent exactly
    assert run_prompt(page, "Hello", max_new_tokens=2) == "done", page.inner_text("#errors")
    assert len([u for u in sent if u.endswith("/v1/generate")]) == 1


def test_attention_of_a_long_prompt_one_layer_at_a_time(page: Any, base_url: str) -> None:
    # all layers' patterns at once as JSON (what the page used to ask for) are over --max-activation-bytes
    old = {
        "prompt": LONG_PROMPT,
        "max_new_tokens": 8,
        "activations": {"hooks": ["blocks.*.attn.hook_pattern"], "format": "json"},
    }
    refused = httpx.post(base_url + "/v1/generate", json=old, headers={"Authorization": f"Bearer {API_KEY}"})
    assert refused.status_code == 413, refused.text
    page.set_viewport_size({"width": 480, "height": 900})
    assert run_prompt(page, LONG_PROMPT, max_new_tokens=8) == "done", page.inner_text("#errors")
    n_generated = int(re.search(r"(\d+) generated", page.inner_text("#output-meta")).group(1))
    (heatmap,) = page.evaluate(CANVAS_INK, "#attn-view canvas.heatmap")
    assert heatmap["positions"] == 100 + n_generated and heatmap["ink"] > 0.3, heatmap
    fits = "() => document.documentElement.scrollWidth <= document.documentElement.clientWidth"
    assert page.evaluate(fits), "the heatmap widens the page"
    # another layer: fetched when chosen
    page.select_option("#attn-layer", "1")
    page.wait_for_selector("#attn-view canvas[aria-label='Attention, layer 1, head 0']")
    # the grid: every tile within the view, however many positions
    page.check('input[name="attn-view"][value="grid"]')
    tiles = page.evaluate(CANVAS_INK, "#attn-view canvas.heatmap")
    assert len(tiles) == N_HEAD and all(t["ink"] > 0.2 for t in tiles), tiles
    view = page.locator("#attn-view").bounding_box()["width"]
    widths = page.locator("#attn-view canvas.heatmap").evaluate_all(
        "cs => cs.map(c => c.getBoundingClientRect().width)"
    )
    assert max(widths) <= view, (widths, view)
    assert page.evaluate(fits)


def test_log_axes_with_nothing_positive_say_so(page: Any) -> None:
    page.check("#log-scale")
    assert run_prompt(page, "a", max_new_tokens=2) == "done", page.inner_text("#errors")
    collapse = page.evaluate(CANVAS_INK, "#chart-collapse")[0]
    assert collapse["ink"] > 0.002, "the collapse chart is blank"
    assert "no positive values to plot on a logarithmic axis" in page.get_attribute("#chart-collapse", "aria-label")


def test_the_page_waits_for_a_loading_model(page: Any) -> None:
    answered: list[int] = []

    def loading_twice(route: Any) -> None:
        if len(answered) < 2:
            answered.append(503)
            body = {"error": {"type": "service_unavailable", "message": "the model is still loading; retry shortly"}}
            route.fulfill(status=503, content_type="application/json", body=json.dumps(body))
        else:
            answered.append(200)
            route.continue_(headers={**route.request.headers, "authorization": f"Bearer {API_KEY}"})

    page.route("**/v1/model", loading_twice)
    page.reload()
    page.wait_for_function("document.querySelector('#model-info').textContent.includes('loading the model')")
    page.wait_for_function("document.querySelector('#model-info').textContent.includes('layers')", timeout=20_000)
    assert answered[:2] == [503, 503] and 200 in answered
    assert page.is_hidden("#errors")


def test_the_api_key_never_goes_into_the_address(browser: Any, base_url: str) -> None:
    """Run pressed before the scripts run (or with JavaScript off) submits the form as a browser does, a GET
    with its fields in the address: the key field has no name, so the key is not among them (nor in the
    history or a proxy's log); with the scripts, the form is never submitted by the browser at all."""
    for scripts in (False, True):
        context = browser.new_context(java_script_enabled=scripts)
        page = context.new_page()
        page.goto(base_url + "/")
        page.fill("#prompt", "Hello")
        page.fill("#api-key", API_KEY)
        page.click("#run")
        page.wait_for_timeout(300)
        assert API_KEY not in page.url
        if scripts:
            assert page.url == base_url + "/"  # no navigation: the page ran the prompt itself
        context.close()


def test_a_temperature_off_the_inputs_step_runs(page: Any) -> None:
    """0.75 is a temperature like any other (the input once had a step of 0.1: the browser refused to submit)."""
    page.fill("#api-key", API_KEY)
    page.fill("#prompt", "Hello")
    page.fill("#max-new-tokens", "2")
    page.fill("#temperature", "0.75")
    page.click("#run")
    assert finished(page) == "done", page.inner_text("#errors")


def test_characters_that_draw_nothing_are_escaped(page: Any) -> None:
    """Also the default-ignorable ones (a variation selector, the Hangul filler), the blank Braille pattern,
    and a combining mark with nothing before it; a mark after its letter is the letter's accent."""
    labels = page.evaluate("() => ['\\ufe0f', '\\u3164', '\\u2800', '\\u0301a', 'e\\u0301', '\\u034f'].map(tokenLabel)")
    assert labels == ["\\ufe0f", "\\u3164", "\\u2800", "\\u0301a", "e\u0301", "\\u034f"]


def test_a_layer_left_while_it_loads_does_not_take_the_view(page: Any) -> None:
    """The run's first layer still loading when the user picks another: its load is aborted (its pass on the
    server stops), and the layer picked is the one drawn, with no error."""
    held: list[Any] = []
    aborted: list[str] = []
    page.on("requestfailed", lambda r: aborted.append(r.url) if r.url.endswith("/v1/activations") else None)

    def hold_layer_0(route: Any) -> None:
        if "blocks.0." in (route.request.post_data or "") and not held:
            held.append(route)
        else:
            route.continue_()

    page.route("**/v1/activations", hold_layer_0)
    page.fill("#api-key", API_KEY)
    page.fill("#prompt", "The cat sat on the mat")
    page.fill("#max-new-tokens", "2")
    page.fill("#temperature", "0")
    page.click("#run")
    while not held:
        page.wait_for_timeout(50)
    page.select_option("#attn-layer", "1")
    page.wait_for_selector("#attn-view canvas.heatmap")
    assert finished(page) == "done", page.inner_text("#errors")
    with contextlib.suppress(sync_api.Error):  # aborted already
        held[0].fulfill(status=429, content_type="application/json", body='{"error": {"message": "late"}}')
    page.wait_for_timeout(500)
    assert aborted and page.input_value("#attn-layer") == "1"
    assert page.locator("#attn-view canvas.heatmap").count() == 1 and page.is_hidden("#errors")
