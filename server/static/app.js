// The residual-stream lab's viewer. It talks only to the public API: GET /v1/model, POST /v1/generate,
// POST /tokenize (the prompt's ids), POST /v1/activations (one layer's attention pattern at a time, as a
// safetensors file) and POST /v1/analyze (per-layer statistics and the logit lens, with and without residual
// connections). Charts are drawn on <canvas>; nothing is fetched from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);

const COLORS = {
  with: "#1f5fa8", // blue, solid line, circles
  without: "#d0590b", // orange, dashed line, squares
  axis: "#444",
  grid: "#e3e6ea",
  text: "#222",
};

// Viridis (perceptually uniform, readable in greyscale and by colour-blind readers), 9 stops.
const VIRIDIS = [
  [68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
  [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37],
];

const state = {
  model: null, // /v1/model
  tokens: [], // labels of prompt + generated positions (attention axes)
  promptLength: undefined, // how many of them are the prompt's
  attn: null, // this run's attention patterns: {ids, signal, loading: layer -> Promise, patterns: layer -> pattern}
  analysis: null, // /v1/analyze
};

// ---------------------------------------------------------------- API

class APIError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status; // the HTTP status, or 0 when the server could not be reached
  }
}

// Paths are relative ("v1/model"), so the page also works where it is served under a prefix (/gpt2/).
// `options.signal` aborts the request (a fetch aborted that way rejects with its AbortError, not an
// APIError); `options.binary` returns the body as an ArrayBuffer. An error answer is reported from its JSON.
async function api(method, path, body, options = {}) {
  const headers = { Accept: options.binary ? "application/octet-stream, application/json" : "application/json" };
  const key = $("api-key").value.trim();
  // a header holds bytes: the key's UTF-8 bytes, one character each, as the server compares them
  if (key) headers.Authorization = `Bearer ${String.fromCharCode(...new TextEncoder().encode(key))}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const where = `${method} /${path}`;
  let response;
  try {
    response = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      signal: options.signal,
    });
    if (response.ok && options.binary) return await response.arrayBuffer();
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new APIError(`${where}: cannot reach the server (${e.message})`, 0);
  }
  const text = await response.text();
  let data = null;
  try {
    data = JSON.parse(text);
  } catch {
    // not JSON: reported below if the status is an error
  }
  if (!response.ok) {
    const err = data && data.error;
    const message = err && err.message ? err.message : text.slice(0, 300) || response.statusText;
    const kind = err && err.type ? ` ${err.type}` : "";
    throw new APIError(`${where} failed (${response.status}${kind}): ${message}`, response.status);
  }
  if (data === null) throw new APIError(`${where}: the answer is not JSON`, response.status);
  return data;
}

// One float32 tensor of a safetensors file: 8 bytes little-endian header length N, N bytes of JSON header
// ({name: {dtype, shape, data_offsets}}), then the data. Returns {shape, data: Float32Array}.
function safetensor(buffer, name) {
  const n = Number(new DataView(buffer).getBigUint64(0, true));
  const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 8, n)));
  const t = header[name];
  if (!t) throw new Error(`the answer has no ${name}`);
  if (t.dtype !== "F32") throw new Error(`${name} is ${t.dtype}, not F32`);
  const start = 8 + n + t.data_offsets[0];
  const end = 8 + n + t.data_offsets[1];
  // A Float32Array over the buffer itself needs a 4-aligned offset; otherwise the bytes are copied.
  const data =
    start % 4 === 0 ? new Float32Array(buffer, start, (end - start) / 4) : new Float32Array(buffer.slice(start, end));
  return { shape: t.shape, data };
}

// ---------------------------------------------------------------- page state

function setStatus(text, stateName) {
  const el = $("status");
  el.textContent = text;
  el.dataset.state = stateName;
}

function showErrors(messages) {
  const box = $("errors");
  box.replaceChildren();
  if (!messages.length) {
    box.hidden = true;
    return;
  }
  const title = document.createElement("strong");
  title.textContent = messages.length === 1 ? "Error" : `${messages.length} errors`;
  const list = document.createElement("ul");
  for (const m of messages) {
    const li = document.createElement("li");
    li.textContent = m;
    list.append(li);
  }
  box.append(title, list);
  box.hidden = false;
}

// How a token is shown: spaces, line breaks and tabs as arrows, a no-break space as ⍽, and any other
// invisible character (controls, format characters such as U+200B, other spaces) as an escape: \x07, \u200b.
const NAMED_CHARACTERS = { " ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍", "\u00a0": "⍽" };

function tokenLabel(t) {
  // controls, format and space characters, those that draw nothing (U+FE0F, U+034F, U+3164, U+2800), and a
  // combining mark with nothing before it to sit on
  return String(t).replace(/[\p{C}\p{Z}\p{Default_Ignorable_Code_Point}\u2800]|^\p{M}/gu, (c) => {
    if (NAMED_CHARACTERS[c]) return NAMED_CHARACTERS[c];
    const code = c.codePointAt(0);
    if (code <= 0xff) return `\\x${code.toString(16).padStart(2, "0")}`;
    return code <= 0xffff ? `\\u${code.toString(16).padStart(4, "0")}` : `\\u{${code.toString(16)}}`;
  });
}

function shorten(s, n) {
  return s.length > n ? `${s.slice(0, n - 1)}…` : s;
}

function layerName(layer) {
  return layer < 0 ? "emb" : String(layer);
}

async function loadModel() {
  const m = await api("GET", "v1/model");
  state.model = m;
  // an int8 model's activations are float32: both said, so that it never reads as a float32 model
  const numbers = m.weights === m.dtype ? m.dtype : `${m.weights} weights, ${m.dtype} activations`;
  $("model-info").textContent =
    `Model: ${m.name} · ${m.n_layer} layers · ${m.n_head} heads · d_model ${m.d_model} · ` +
    `context ${m.n_ctx} · ${numbers} on ${m.device}`;
  $("model-info").title = m.quantization || "";
  return m;
}

// `load()`, tried again every 2 s while the server answers that the model is still loading (a 503 that says
// so: a 503 of the connection cap is an error like any other), calling `waiting()` each time; it ends on
// success or on any other error, which it throws.
async function whileLoading(load, waiting = () => {}) {
  for (;;) {
    try {
      return await load();
    } catch (e) {
      if (!(e instanceof APIError) || e.status !== 503 || !/loading/.test(e.message)) throw e;
      waiting();
      await new Promise((resolve) => setTimeout(resolve, 2000));
    }
  }
}

// ---------------------------------------------------------------- run

// Runs of one kind (the page's, the gradient highway's), where a new run supersedes the one in flight: its
// requests are aborted (the server stops their work) and anything it still draws is dropped. `start` gives the
// new run's abort signal and `current()`, whether it is still the latest; `stop` supersedes the one in flight
// with none.
class Runs {
  constructor() {
    this.latest = 0;
    this.controller = null;
  }

  start() {
    this.stop();
    const id = this.latest;
    this.controller = new AbortController();
    return { signal: this.controller.signal, current: () => id === this.latest };
  }

  stop() {
    this.latest++;
    if (this.controller) this.controller.abort();
    this.controller = null;
  }
}

const runs = new Runs();

// A seed the page can send exactly: an integer of at most 2^53 - 1 in magnitude (JSON numbers in the
// browser are doubles), written as the number field takes it ("42", "1e3", "7.0"). Its digits are read
// exactly: "1.0000000000000001" is not a whole number, though a double rounds it to 1. Throws a message for
// any other; null for none.
function parseSeed(text) {
  if (text === "") return null;
  const notWhole = new Error(`the seed must be a whole number, not “${text}”`);
  const m = /^([+-]?)(\d*)(?:\.(\d*))?(?:e([+-]?\d+))?$/i.exec(text);
  if (!m || !(m[2] + (m[3] || ""))) throw notWhole;
  let digits = (m[2] + (m[3] || "")).replace(/^0+(?=\d)/, "");
  const shift = Number(m[4] || 0) - (m[3] || "").length; // the value is digits × 10^shift
  if (shift < 0) {
    const whole = Math.max(digits.length + shift, 0);
    if (/[1-9]/.test(digits.slice(whole))) throw notWhole;
    digits = digits.slice(0, whole) || "0";
  } else if (/[1-9]/.test(digits)) {
    digits += "0".repeat(Math.min(shift, 20)); // beyond 20 digits it is too large all the same
  }
  const seed = Number(`${m[1]}${digits}`);
  if (!Number.isSafeInteger(seed)) {
    throw new Error(
      `the seed ${text} is too large: the page sends seeds exactly only up to ±${Number.MAX_SAFE_INTEGER} (2^53 − 1)`,
    );
  }
  return seed;
}

// Empty the panels a run fills, so that none shows an earlier prompt's result.
function clearResults() {
  $("prompt-echo").textContent = "";
  $("generated-text").textContent = "";
  $("output-meta").textContent = "";
  state.tokens = [];
  state.attn = null;
  state.promptLength = undefined;
  $("attn-layer").disabled = true;
  $("attn-head").disabled = true;
  attentionMessage("Waiting for the generation…");
  state.analysis = null;
  for (const c of CHARTS) blankCanvas($(c.id));
  $("resid-table").replaceChildren();
  $("lens-table").replaceChildren();
}

function attentionMessage(text, isError) {
  $("attn-tooltip").hidden = true;
  const p = document.createElement("p");
  p.className = isError ? "placeholder error-text" : "placeholder muted";
  p.textContent = text;
  const container = $("attn-view");
  container.classList.remove("grid");
  container.replaceChildren(p);
}

// A canvas kept at its size, painted white (a chart with nothing to show).
function blankCanvas(canvas) {
  const ctx = canvas.getContext("2d");
  ctx.setTransform(1, 0, 0, 1, 0, 0);
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  canvas.setAttribute("aria-label", "Chart: no data");
}

async function run(event) {
  event.preventDefault();
  const { signal, current } = runs.start();
  const button = $("run");
  button.disabled = true;
  showErrors([]);
  clearResults();
  setStatus("Running…", "running");
  const started = performance.now();
  const errors = [];
  const prompt = $("prompt").value;
  let seed = null;
  try {
    seed = parseSeed($("seed").value.trim());
    if (!state.model) await whileLoading(loadModel, () => setStatus("Waiting for the model to load…", "running"));
  } catch (e) {
    if (!current()) return;
    errors.push(e.message);
    attentionMessage("No attention patterns: the run was refused (see the errors above).", true);
  }
  if (!errors.length) {
    const genBody = {
      prompt,
      max_new_tokens: Number($("max-new-tokens").value),
      temperature: Number($("temperature").value),
    };
    if (seed !== null) genBody.seed = seed;
    const [gen, analysis, tokenized] = await Promise.allSettled([
      api("POST", "v1/generate", genBody, { signal }),
      api("POST", "v1/analyze", { prompt, compare_ablated: true }, { signal }),
      api("POST", "tokenize", { prompt }, { signal }), // the prompt's ids, for the attention patterns
    ]);
    if (!current()) return;
    const draw = (what, fn) => {
      try {
        fn();
      } catch (e) {
        errors.push(`cannot draw the ${what}: ${e.message}`);
        console.error(e);
      }
    };
    if (analysis.status === "fulfilled") draw("analysis", () => renderAnalysis(analysis.value));
    else if (analysis.reason.status === 413) {
      // the server's advice names fields this page does not offer: what the page asks for, and what fits
      errors.push(
        `${analysis.reason.message} (this page asks for the lens's top 5 tokens with and without the residual ` +
          "connections: a shorter prompt fits)",
      );
    } else errors.push(analysis.reason.message);
    if (gen.status === "fulfilled") {
      const promptTokens = analysis.status === "fulfilled" ? analysis.value.tokens : null;
      draw("generation", () => renderGeneration(prompt, promptTokens, gen.value));
      if (tokenized.status === "fulfilled") {
        const ids = tokenized.value.tokens.concat(gen.value.choices[0].token_ids);
        state.attn = { ids, signal, loading: new Map(), patterns: new Map() };
        fillSelect($("attn-layer"), state.model.n_layer, (i) => `layer ${i}`);
        fillSelect($("attn-head"), state.model.n_head, (i) => `head ${i}`);
        const layer = Number($("attn-layer").value);
        attentionMessage(`Loading layer ${layer}…`);
        try {
          await loadLayer(layer);
          if (!current()) return;
          if (Number($("attn-layer").value) === layer) {
            draw("attention", () => drawAttention(state.attn.patterns.get(layer), layer));
          }
        } catch (e) {
          if (!current()) return;
          if (e.name !== "AbortError") {
            errors.push(e.message); // aborted: the user moved to another layer, which shows itself
            if (Number($("attn-layer").value) === layer) attentionMessage(`Layer ${layer}: ${e.message}`, true);
          }
        }
      } else {
        errors.push(tokenized.reason.message);
        attentionMessage("No attention patterns: the prompt was not tokenized (see the errors above).", true);
      }
    } else {
      errors.push(gen.reason.message);
      attentionMessage("No attention patterns: the generation failed (see the errors above).", true);
    }
  }
  showErrors(errors);
  const seconds = ((performance.now() - started) / 1000).toFixed(1);
  setStatus(errors.length ? `Finished with errors in ${seconds} s.` : `Done in ${seconds} s.`, errors.length ? "error" : "done");
  button.disabled = false;
}

// ---------------------------------------------------------------- generated text and attention

function renderGeneration(prompt, promptTokens, gen) {
  const choice = gen.choices[0];
  $("prompt-echo").textContent = prompt;
  $("generated-text").textContent = choice.text;
  const u = gen.usage;
  $("output-meta").textContent =
    `${u.prompt_tokens} prompt tokens, ${u.completion_tokens} generated · finish reason: ${choice.finish_reason}`;
  const labels = (promptTokens || Array.from({ length: u.prompt_tokens }, (_, i) => `#${i}`)).concat(choice.tokens);
  state.tokens = labels;
  state.promptLength = u.prompt_tokens;
}

// One layer's attention pattern over prompt and generated positions, {heads, T, data: [head][query][key] as
// a flat Float32Array}, from POST /v1/activations: one forward pass over the prompt's and the generated ids
// gives the very weights the generation used. Fetched when the layer is first shown, then kept for this run.
// At most KEPT_LAYERS layers' patterns are kept (the least recently shown goes first): a layer of gpt2-xl at
// 1,024 tokens is 100 MB. A layer that is still loading when another is asked for stops loading.
const KEPT_LAYERS = 3;

function loadLayer(layer) {
  const attn = state.attn;
  for (const [other, load] of attn.loading) {
    if (other !== layer && !attn.patterns.has(other)) {
      load.controller.abort(); // its forward pass on the server stops too
      attn.loading.delete(other);
    }
  }
  if (!attn.loading.has(layer)) {
    const name = `blocks.${layer}.attn.hook_pattern`;
    const body = { input_ids: attn.ids, max_new_tokens: 0, activations: { hooks: [name], dtype: "float32" } };
    const controller = new AbortController();
    attn.signal.addEventListener("abort", () => controller.abort()); // a new run aborts this one's loads
    const promise = api("POST", "v1/activations", body, { signal: controller.signal, binary: true }).then((buffer) => {
      const { shape, data } = safetensor(buffer, name); // [1, head, query, key]
      const pattern = { heads: shape[1], T: shape[3], data };
      attn.patterns.set(layer, pattern);
      for (const oldest of attn.patterns.keys()) {
        if (attn.patterns.size <= KEPT_LAYERS) break;
        attn.patterns.delete(oldest);
        attn.loading.delete(oldest);
      }
      return pattern;
    });
    promise.catch(() => attn.loading.delete(layer)); // a layer that failed is asked for again when next shown
    attn.loading.set(layer, { promise, controller });
  }
  return attn.loading.get(layer).promise;
}

function fillSelect(select, count, label) {
  const keep = Number(select.value) || 0;
  select.replaceChildren();
  for (let i = 0; i < count; i++) select.add(new Option(label(i), String(i)));
  select.value = String(Math.min(keep, count - 1));
  select.disabled = false;
}

function attentionView() {
  return document.querySelector('input[name="attn-view"]:checked').value;
}

// The layer chosen, drawn at once if its pattern is here; otherwise fetched first ("Loading layer L…") and
// drawn only if the same run and layer are still the ones shown when it arrives.
async function showAttention() {
  const attn = state.attn;
  if (!attn) return;
  const layer = Number($("attn-layer").value);
  const shown = () => state.attn === attn && Number($("attn-layer").value) === layer;
  const kept = attn.patterns.get(layer);
  if (kept) {
    attn.patterns.delete(layer); // the most recently shown: the last to go
    attn.patterns.set(layer, kept);
  } else {
    attentionMessage(`Loading layer ${layer}…`);
    try {
      await loadLayer(layer);
    } catch (e) {
      if (shown() && e.name !== "AbortError") attentionMessage(`Layer ${layer}: ${e.message}`, true);
      return;
    }
    if (!shown()) return;
  }
  drawAttention(attn.patterns.get(layer), layer);
}

// One layer's heads: one heatmap, or the grid of all of them.
function drawAttention(pattern, layer) {
  const container = $("attn-view");
  $("attn-tooltip").hidden = true;
  const grid = attentionView() === "grid";
  $("attn-head-label").hidden = grid;
  container.replaceChildren();
  container.classList.toggle("grid", grid);
  const { T, heads, data } = pattern;
  const tokens = Array.from({ length: T }, (_, i) => (i < state.tokens.length ? state.tokens[i] : `#${i}`));
  const head = (h) => ({ T, data: data.subarray(h * T * T, (h + 1) * T * T), ids: state.attn.ids });
  const width = container.clientWidth || 800;
  if (!grid) {
    const h = Number($("attn-head").value);
    const canvas = heatmapCanvas(`Attention, layer ${layer}, head ${h}`);
    container.append(canvas);
    drawHeatmap(canvas, head(h), tokens, {
      size: Math.min(width - 180, 640),
      title: `layer ${layer} · head ${h}`,
      labels: true,
      legend: true,
      tooltip: true,
    });
    return;
  }
  const cols = width >= 900 ? 4 : width >= 600 ? 3 : 2;
  const size = Math.max(60, Math.floor((width - 90) / cols) - 56); // room for each tile's margins and the colour scale
  for (let h = 0; h < heads; h++) {
    const canvas = heatmapCanvas(`Attention, layer ${layer}, head ${h}; click to enlarge`);
    canvas.tabIndex = 0;
    canvas.classList.add("clickable");
    const open = async () => {
      $("attn-head").value = String(h);
      document.querySelector('input[name="attn-view"][value="head"]').checked = true;
      await showAttention();
      // the grid the focus was on is gone: it moves to the heatmap that took its place (reached by no Tab)
      const enlarged = $("attn-view").querySelector("canvas.heatmap");
      if (enlarged && !$("attn-view").classList.contains("grid")) {
        enlarged.tabIndex = -1;
        enlarged.focus();
      }
    };
    canvas.addEventListener("click", open);
    canvas.addEventListener("keydown", (e) => {
      if (e.key === "Enter" || e.key === " ") {
        e.preventDefault();
        open();
      }
    });
    container.append(canvas);
    // a tile is never wider than its share of the row: fewer than one pixel per position if need be
    drawHeatmap(canvas, head(h), tokens, { size, fit: true, title: `head ${h}`, labels: size / T >= 9, legend: false });
  }
  const legend = document.createElement("canvas");
  legend.setAttribute("role", "img");
  legend.setAttribute("aria-label", "Colour scale: attention weight from 0 to 1");
  legend.classList.add("grid-legend");
  container.append(legend);
  drawColorbar(legend);
}

function heatmapCanvas(label) {
  const canvas = document.createElement("canvas");
  canvas.className = "heatmap";
  canvas.setAttribute("role", "img");
  canvas.setAttribute("aria-label", label);
  return canvas;
}

function viridis(v) {
  const x = Math.max(0, Math.min(1, v)) * (VIRIDIS.length - 1);
  const i = Math.min(Math.floor(x), VIRIDIS.length - 2);
  const f = x - i;
  const [a, b] = [VIRIDIS[i], VIRIDIS[i + 1]];
  return [0, 1, 2].map((k) => Math.round(a[k] + (b[k] - a[k]) * f));
}

// A canvas sized in CSS pixels, drawn at the device's resolution.
function prepare(canvas, width, height) {
  const dpr = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * dpr);
  canvas.height = Math.round(height * dpr);
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, width, height);
  return ctx;
}

// `pattern`: {T, data: [query][key] as a flat array, ids: the positions' token ids}. With `opts.fit` the
// map is at most `opts.size` wide whatever T (less than a pixel per position), else at least 2 px a position.
function drawHeatmap(canvas, pattern, tokens, opts) {
  const T = pattern.T;
  const weight = (q, k) => pattern.data[q * T + k];
  const labelChars = opts.labels ? Math.min(12, Math.max(...tokens.map((t) => tokenLabel(t).length), 2)) : 0;
  const labelSpace = opts.labels ? 12 + labelChars * 6.6 : 14;
  const left = labelSpace + 22; // query labels and the y axis title
  const top = 24; // title
  const bottom = labelSpace + 24; // key labels and the x axis title
  const right = opts.legend ? 78 : 8;
  const side = Math.min(Math.max(opts.size, 60, opts.fit ? 0 : 2 * T), 32 * T); // cells of up to 32 pixels
  const cell = side / T;
  const width = left + side + right;
  const height = top + side + bottom;
  const ctx = prepare(canvas, width, height);
  canvas.dataset.positions = String(T);

  const image = ctx.createImageData(T, T);
  for (let q = 0; q < T; q++) {
    for (let k = 0; k < T; k++) {
      const v = weight(q, k);
      const o = (q * T + k) * 4;
      if (k > q || !Number.isFinite(v)) {
        image.data.set([246, 246, 246, 255], o); // masked: a query never sees later keys
      } else {
        image.data.set([...viridis(v), 255], o);
      }
    }
  }
  // Scale the T × T image up without smoothing, one block per weight (scaled down, smoothed).
  const tmp = document.createElement("canvas");
  tmp.width = T;
  tmp.height = T;
  tmp.getContext("2d").putImageData(image, 0, 0);
  ctx.imageSmoothingEnabled = cell < 1;
  ctx.drawImage(tmp, left, top, side, side);
  ctx.strokeStyle = COLORS.axis;
  ctx.lineWidth = 1;
  ctx.strokeRect(left - 0.5, top - 0.5, side + 1, side + 1);

  ctx.fillStyle = COLORS.text;
  ctx.font = "600 13px system-ui, sans-serif";
  ctx.textAlign = "center";
  ctx.textBaseline = "alphabetic";
  ctx.fillText(opts.title, left + side / 2, 16);

  ctx.font = "11px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace";
  if (opts.labels) {
    const every = Math.max(1, Math.ceil(11 / cell));
    for (let i = 0; i < T; i += every) {
      const text = shorten(tokenLabel(tokens[i]), 12);
      const generated = state.promptLength !== undefined && i >= state.promptLength;
      ctx.fillStyle = generated ? COLORS.without : COLORS.text;
      ctx.textAlign = "right";
      ctx.textBaseline = "middle";
      ctx.fillText(text, left - 5, top + (i + 0.5) * cell);
      ctx.save();
      ctx.translate(left + (i + 0.5) * cell, top + side + 5);
      ctx.rotate(-Math.PI / 2);
      ctx.fillText(text, 0, 0);
      ctx.restore();
    }
  }
  ctx.fillStyle = COLORS.text;
  ctx.font = "12px system-ui, sans-serif";
  ctx.textAlign = "center";
  ctx.textBaseline = "alphabetic";
  ctx.fillText("key position (attended to)", left + side / 2, height - 6);
  ctx.save();
  ctx.translate(12, top + side / 2);
  ctx.rotate(-Math.PI / 2);
  ctx.fillText("query position (attending)", 0, 0);
  ctx.restore();

  if (opts.legend) drawColorbarAt(ctx, left + side + 22, top, Math.min(side, 220));

  canvas.onmousemove = null;
  canvas.onmouseleave = null;
  if (opts.tooltip) {
    const tip = $("attn-tooltip");
    canvas.onmousemove = (e) => {
      const r = canvas.getBoundingClientRect();
      const k = Math.floor((e.clientX - r.left - left) / cell);
      const q = Math.floor((e.clientY - r.top - top) / cell);
      if (q < 0 || k < 0 || q >= T || k >= T || k > q) {
        tip.hidden = true;
        return;
      }
      const token = (i) => `${i} “${tokenLabel(tokens[i])}” (id ${pattern.ids[i]})`;
      tip.textContent = `query ${token(q)} → key ${token(k)}: weight ${weight(q, k).toFixed(3)}`;
      tip.style.left = `${e.pageX + 12}px`;
      tip.style.top = `${e.pageY + 12}px`;
      tip.hidden = false;
    };
    canvas.onmouseleave = () => {
      tip.hidden = true;
    };
  }
}

function drawColorbar(canvas) {
  const ctx = prepare(canvas, 90, 180);
  drawColorbarAt(ctx, 10, 24, 140);
}

function drawColorbarAt(ctx, x, y, h) {
  const w = 14;
  for (let i = 0; i < h; i++) {
    const [r, g, b] = viridis(1 - i / (h - 1));
    ctx.fillStyle = `rgb(${r},${g},${b})`;
    ctx.fillRect(x, y + i, w, 1);
  }
  ctx.strokeStyle = COLORS.axis;
  ctx.strokeRect(x - 0.5, y - 0.5, w + 1, h + 1);
  ctx.fillStyle = COLORS.text;
  ctx.font = "11px system-ui, sans-serif";
  ctx.textAlign = "left";
  ctx.textBaseline = "middle";
  for (const v of [0, 0.25, 0.5, 0.75, 1]) ctx.fillText(v.toFixed(2), x + w + 5, y + (1 - v) * (h - 1));
  ctx.textBaseline = "alphabetic";
  ctx.fillText("weight", x - 6, y - 8);
}

// ---------------------------------------------------------------- residual-stream curves

const CHARTS = [
  { id: "chart-norm", title: "Residual norm (mean over positions)", y: "‖x‖", value: (s) => mean(s.norms) },
  { id: "chart-rank", title: "Effective rank", y: "effective rank", value: (s) => s.effective_rank },
  { id: "chart-collapse", title: "Rank-collapse measure", y: "‖X − 1x̄ᵀ‖ / ‖X‖", value: (s) => s.collapse },
  { id: "chart-cosine", title: "Mean pairwise cosine similarity", y: "cosine", value: (s) => s.mean_cosine },
];

function mean(xs) {
  return xs.reduce((a, b) => a + b, 0) / xs.length;
}

function renderAnalysis(analysis) {
  state.analysis = analysis;
  drawCurves();
  renderNumbers();
  renderLens();
}

function drawCurves() {
  const a = state.analysis;
  if (!a) return;
  const log = $("log-scale").checked;
  for (const c of CHARTS) {
    const canvas = $(c.id);
    const series = [{ name: "with residual connections", key: "with", values: a.layers.map(c.value) }];
    if (a.ablated) series.push({ name: "without residual connections", key: "without", values: a.ablated.map(c.value) });
    const width = canvas.parentElement.clientWidth || 480;
    const note = lineChart(canvas, {
      width,
      height: 260,
      title: c.title,
      xLabels: a.layers.map((s) => layerName(s.layer)),
      xTitle: "layer (emb = embeddings)",
      yTitle: c.y + (log ? " (log scale)" : ""),
      series,
      log,
    });
    const describe = (s) => `${s.name}: ${s.values.map((v) => fmt(v)).join(", ")}`;
    canvas.setAttribute("aria-label", `${c.title} by layer${note ? ` (${note})` : ""}. ${series.map(describe).join(". ")}`);
  }
}

function fmt(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  return a !== 0 && (a < 0.01 || a >= 1e4) ? v.toExponential(2) : v.toFixed(a < 10 ? 3 : 1);
}

// Round tick values covering [lo, hi], about `count` of them, and the decimals their step needs.
function niceTicks(lo, hi, count) {
  const span = hi - lo || Math.abs(hi) || 1;
  const step0 = span / count;
  const mag = 10 ** Math.floor(Math.log10(step0));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= step0 * (1 - 1e-9));
  const first = Math.floor(lo / step + 1e-9);
  const last = Math.ceil(hi / step - 1e-9);
  const ticks = [];
  for (let i = first; i <= last; i++) ticks.push(Number((i * step).toPrecision(12)));
  const decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9) + (step / mag === 2.5 ? 1 : 0));
  return { ticks, decimals };
}

// Ticks of a log10 axis over [lo, hi] (log10 units): at 1-2-5 × 10^k, or denser or sparser as the span needs.
function logTicks(lo, hi) {
  for (const mantissas of [[1], [1, 2, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9]]) {
    const ticks = [];
    for (let k = Math.floor(lo) - 1; k <= Math.ceil(hi); k++) {
      for (const m of mantissas) {
        const t = Math.log10(m) + k;
        if (t >= lo && t <= hi) ticks.push(t);
      }
    }
    if (ticks.length >= 3 && (mantissas.length > 1 || ticks.length <= 8)) return ticks.length > 9 ? ticks.filter((_, i) => i % 2 === 0) : ticks;
  }
  return [lo, (lo + hi) / 2, hi];
}

function lineChart(canvas, o) {
  const ctx = prepare(canvas, o.width, o.height);
  const m = { left: 64, right: 16, top: 30, bottom: 46 };
  const w = o.width - m.left - m.right;
  const h = o.height - m.top - m.bottom;
  const all = o.series.flatMap((s) => s.values).filter((v) => Number.isFinite(v) && (!o.log || v > 0));
  if (!all.length) {
    // nothing to draw (a one-token prompt's collapse measure is 0 at every layer): say so under the title
    ctx.fillStyle = COLORS.text;
    ctx.textAlign = "center";
    ctx.font = "600 13px system-ui, sans-serif";
    ctx.fillText(o.title, m.left + w / 2, 18);
    ctx.font = "12px system-ui, sans-serif";
    ctx.fillStyle = COLORS.axis;
    const note = o.log ? "no positive values to plot on a logarithmic axis" : "no finite values to plot";
    ctx.fillText(note, m.left + w / 2, m.top + h / 2);
    return note;
  }
  const tf = o.log ? Math.log10 : (v) => v;
  let lo = tf(Math.min(...all));
  let hi = tf(Math.max(...all));
  if (!o.log) lo = Math.min(lo, 0); // linear axes start at 0 when the data allow, so heights compare honestly
  if (hi - lo < 1e-9) {
    hi += o.log ? 0.15 : 0.5;
    lo -= o.log ? 0.15 : 0.5;
  }
  let ticks;
  let tickLabel;
  if (o.log) {
    const pad = (hi - lo) * 0.06;
    lo -= pad;
    hi += pad;
    ticks = logTicks(lo, hi);
    tickLabel = (t) => String(Number((10 ** t).toPrecision(3)));
  } else {
    const nice = niceTicks(lo, hi, 5);
    ticks = nice.ticks;
    lo = ticks[0];
    hi = ticks[ticks.length - 1];
    tickLabel = (t) => t.toFixed(nice.decimals);
  }
  const n = o.xLabels.length;
  const X = (i) => m.left + (n === 1 ? w / 2 : (i / (n - 1)) * w);
  const Y = (v) => m.top + h - ((tf(v) - lo) / (hi - lo)) * h;

  ctx.font = "11px system-ui, sans-serif";
  ctx.lineWidth = 1;
  ctx.fillStyle = COLORS.text;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  let lastY = Infinity;
  for (const t of ticks) {
    const y = m.top + h - ((t - lo) / (hi - lo)) * h;
    if (lastY - y < 20) continue; // labels never crowd (dense log ticks)
    lastY = y;
    ctx.strokeStyle = COLORS.grid;
    ctx.beginPath();
    ctx.moveTo(m.left, Math.round(y) + 0.5);
    ctx.lineTo(m.left + w, Math.round(y) + 0.5);
    ctx.stroke();
    ctx.fillText(tickLabel(t), m.left - 6, y);
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  const every = Math.max(1, Math.ceil(n / Math.max(1, Math.floor(w / 28))));
  for (let i = 0; i < n; i += every) ctx.fillText(o.xLabels[i], X(i), m.top + h + 6);
  ctx.strokeStyle = COLORS.axis;
  ctx.beginPath();
  ctx.moveTo(m.left + 0.5, m.top);
  ctx.lineTo(m.left + 0.5, m.top + h + 0.5);
  ctx.lineTo(m.left + w, m.top + h + 0.5);
  ctx.stroke();

  ctx.font = "600 13px system-ui, sans-serif";
  ctx.textBaseline = "alphabetic";
  ctx.fillText(o.title, m.left + w / 2, 18);
  ctx.font = "12px system-ui, sans-serif";
  ctx.fillText(o.xTitle, m.left + w / 2, o.height - 8);
  ctx.save();
  ctx.translate(14, m.top + h / 2);
  ctx.rotate(-Math.PI / 2);
  ctx.fillText(o.yTitle, 0, 0);
  ctx.restore();

  for (const s of o.series) {
    const color = COLORS[s.key];
    ctx.strokeStyle = color;
    ctx.fillStyle = color;
    ctx.lineWidth = 2;
    ctx.setLineDash(s.key === "without" ? [6, 4] : []);
    ctx.beginPath();
    let pen = false;
    s.values.forEach((v, i) => {
      if (!Number.isFinite(v) || (o.log && v <= 0)) {
        pen = false;
        return;
      }
      if (pen) ctx.lineTo(X(i), Y(v));
      else ctx.moveTo(X(i), Y(v));
      pen = true;
    });
    ctx.stroke();
    ctx.setLineDash([]);
    s.values.forEach((v, i) => {
      if (!Number.isFinite(v) || (o.log && v <= 0)) return;
      ctx.beginPath();
      if (s.key === "without") ctx.rect(X(i) - 3.5, Y(v) - 3.5, 7, 7);
      else ctx.arc(X(i), Y(v), 3.5, 0, 2 * Math.PI);
      ctx.fill();
    });
  }
}

function renderNumbers() {
  const a = state.analysis;
  const table = $("resid-table");
  table.replaceChildren();
  const caption = table.createCaption();
  caption.textContent = "Per-layer statistics of the residual stream (with / without residual connections)";
  const head = table.createTHead().insertRow();
  const columns = ["layer", ...CHARTS.flatMap((c) => [`${c.title}, with`, "without"])];
  for (const name of columns) {
    const th = document.createElement("th");
    th.scope = "col";
    th.textContent = name;
    head.append(th);
  }
  const body = table.createTBody();
  a.layers.forEach((s, i) => {
    const row = body.insertRow();
    const th = document.createElement("th");
    th.scope = "row";
    th.textContent = layerName(s.layer);
    row.append(th);
    for (const c of CHARTS) {
      row.insertCell().textContent = fmt(c.value(s));
      row.insertCell().textContent = a.ablated ? fmt(c.value(a.ablated[i])) : "–";
    }
  });
}

// ---------------------------------------------------------------- logit lens

function renderLens() {
  const a = state.analysis;
  if (!a) return;
  const which = document.querySelector('input[name="lens-run"]:checked').value;
  const stats = (which === "ablated" && a.ablated) || a.layers;
  const table = $("lens-table");
  table.replaceChildren();
  const caption = table.createCaption();
  caption.textContent =
    `Logit lens ${stats === a.ablated ? "without" : "with"} residual connections: ` +
    "top next token and its probability, per layer (rows) and prompt position (columns)";
  const head = table.createTHead().insertRow();
  const corner = document.createElement("th");
  corner.scope = "col";
  corner.textContent = "layer \\ position";
  head.append(corner);
  a.tokens.forEach((t, i) => {
    const th = document.createElement("th");
    th.scope = "col";
    th.innerHTML = `<span class="pos">${i}</span>`;
    const tok = document.createElement("span");
    tok.className = "tok";
    tok.textContent = tokenLabel(t);
    th.title = `position ${i}: ${tokenLabel(t)} (id ${a.input_ids[i]})`;
    th.append(tok);
    head.append(th);
  });
  const body = table.createTBody();
  for (const s of stats) {
    const row = body.insertRow();
    const th = document.createElement("th");
    th.scope = "row";
    th.textContent = layerName(s.layer);
    row.append(th);
    s.logit_lens.forEach((top, pos) => {
      const cell = row.insertCell();
      const best = top[0];
      const tok = document.createElement("span");
      tok.className = "tok";
      tok.textContent = tokenLabel(best.token);
      const prob = document.createElement("span");
      prob.className = "prob";
      prob.textContent = best.prob >= 0.995 ? "1.00" : best.prob.toFixed(2);
      cell.append(tok, prob);
      cell.style.backgroundColor = `rgba(31, 95, 168, ${(0.06 + 0.5 * best.prob).toFixed(3)})`;
      cell.title =
        `layer ${layerName(s.layer)}, position ${pos} (${tokenLabel(a.tokens[pos])}, id ${a.input_ids[pos]}):\n` +
        top.map((c) => `${tokenLabel(c.token)} (id ${c.id})  ${(100 * c.prob).toFixed(1)}%`).join("\n");
      if (pos + 1 < a.tokens.length && best.id === a.input_ids[pos + 1]) cell.classList.add("hit");
    });
  }
}

// ---------------------------------------------------------------- wiring

function debounce(fn, ms) {
  let timer;
  return () => {
    clearTimeout(timer);
    timer = setTimeout(fn, ms);
  };
}

window.addEventListener("DOMContentLoaded", () => {
  $("run-form").addEventListener("submit", run);
  // Ctrl+Enter runs the prompt, also during a run: the new run supersedes the one in flight.
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      $("run-form").requestSubmit();
    }
  });
  $("attn-layer").addEventListener("change", showAttention);
  $("attn-head").addEventListener("change", showAttention);
  for (const r of document.querySelectorAll('input[name="attn-view"]')) r.addEventListener("change", showAttention);
  for (const r of document.querySelectorAll('input[name="lens-run"]')) r.addEventListener("change", renderLens);
  $("log-scale").addEventListener("change", drawCurves);
  window.addEventListener(
    "resize",
    debounce(() => {
      showAttention();
      drawCurves();
    }, 150),
  );
  const loading = () => {
    $("model-info").textContent = "Model: loading the model…";
  };
  whileLoading(loadModel, loading).catch((e) => {
    $("model-info").textContent = "Model: not loaded";
    showErrors([e.message]);
  });
});
