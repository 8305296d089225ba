// The gradient panels of the viewer: the gradient highway (POST /v1/analyze with "gradients": true) beside
// the rank-collapse curves, and attribution patching (POST /v1/attribution) as heatmaps. Loaded after app.js,
// whose helpers it uses (api, lineChart, prepare, fmt, layerName, tokenLabel, shorten, COLORS).
"use strict";

const gradState = { highway: null, attribution: null };
const highwayRuns = new Runs(); // as app.js's runs: a new run supersedes the one in flight

// `whileLoading`'s note in a panel's status line while the server still loads its model.
const waitingIn = (status) => () => {
  status.textContent = "Waiting for the model to load…";
};

// ---------------------------------------------------------------- the gradient highway

async function runHighway() {
  const { signal, current } = highwayRuns.start();
  const status = $("grad-status");
  // the previous prompt's highway is gone before this one's is asked for: a failure leaves the charts empty
  gradState.highway = null;
  blankCanvas($("chart-grad"));
  blankCanvas($("chart-jacobian"));
  try {
    parseSeed($("seed").value.trim()); // a run the page refuses (app.js says why) measures nothing either
  } catch {
    status.textContent = "Not measured: the run was refused (see the errors above).";
    status.dataset.state = "error";
    return;
  }
  status.textContent = "Measuring the gradient…";
  status.dataset.state = "running";
  try {
    const request = { prompt: $("prompt").value, compare_ablated: true, gradients: true, top_k: 1 };
    const highway = await whileLoading(() => api("POST", "v1/analyze", request, { signal }), waitingIn(status));
    if (!current()) return;
    gradState.highway = highway;
    drawHighway();
    status.dataset.state = "done";
  } catch (e) {
    if (!current()) return; // superseded (aborted): the newer run reports
    status.textContent = e.message;
    status.dataset.state = "error";
  }
}

// The highway's charts and its status line; with no highway (none yet, or the run failed) it leaves both.
function drawHighway() {
  const a = gradState.highway;
  if (!a) return;
  const x = a.layers.map((s) => layerName(s.layer));
  const blocks = a.layers.filter((s) => s.jacobian_norm !== null);
  const series = (value, rows, ablatedRows) => {
    const out = [{ name: "with residual connections", key: "with", values: rows.map(value) }];
    if (ablatedRows) out.push({ name: "without residual connections", key: "without", values: ablatedRows.map(value) });
    return out;
  };
  const ablatedBlocks = a.ablated ? a.ablated.filter((s) => s.jacobian_norm !== null) : null;
  const charts = [
    {
      id: "chart-grad",
      title: "Loss gradient at the stream",
      yTitle: "‖∂loss/∂x‖ (log scale)",
      xLabels: x,
      xTitle: "layer (emb = embeddings)",
      series: series((s) => s.grad_norm, a.layers, a.ablated),
      log: true,
    },
    {
      id: "chart-jacobian",
      title: "Block Jacobian RMS gain ‖J‖_F / √n",
      yTitle: "RMS gain (1 = the identity)",
      xLabels: blocks.map((s) => String(s.layer)),
      xTitle: "block",
      series: [
        ...series((s) => s.jacobian_norm, blocks, ablatedBlocks),
        { name: "the identity", key: "axis", values: blocks.map(() => 1) },
      ],
      log: false,
    },
  ];
  for (const c of charts) {
    const canvas = $(c.id);
    lineChart(canvas, { width: canvas.parentElement.clientWidth || 480, height: 260, ...c });
    const describe = (s) => `${s.name}: ${s.values.map((v) => fmt(v)).join(", ")}`;
    canvas.setAttribute("aria-label", `${c.title} by layer. ${c.series.map(describe).join(". ")}`);
  }
  const ratio = (rows) => rows[0].grad_norm / rows[rows.length - 1].grad_norm;
  let text = `First / last layer gradient norm: ${fmt(ratio(a.layers))} with the residual connections`;
  if (a.ablated) text += `, ${fmt(ratio(a.ablated))} without.`;
  $("grad-status").textContent = text;
}

// ---------------------------------------------------------------- attribution patching

// A token box holds a token's text exactly as typed (" 2", with its leading space, is the token " 2"), or
// `#id` and nothing else for a token id (#362): a bare number is text, never an id.
function attributionMetric() {
  const type = $("attr-metric").value;
  const token = (id) => {
    const v = $(id).value;
    return /^#\d+$/.test(v) ? Number(v.slice(1)) : v;
  };
  if (type === "loss") return { type };
  if (type === "logprob") return { type, token: token("attr-token-a") };
  return { type, tokens: [token("attr-token-a"), token("attr-token-b")] };
}

async function runAttribution() {
  const status = $("attr-status");
  const button = $("attr-run");
  button.disabled = true;
  // the previous prompts' attribution is gone before this one's is asked for: a failure leaves the panel empty
  gradState.attribution = null;
  for (const id of ["attr-resid", "attr-heads", "attr-sublayers"]) {
    blankCanvas($(id));
    delete $(id).dataset.cells;
  }
  $("attr-verified").replaceChildren();
  status.textContent = "Attributing…";
  status.dataset.state = "running";
  try {
    const request = {
      clean: $("attr-clean").value,
      corrupted: $("attr-corrupted").value,
      metric: attributionMetric(),
      verify: Number($("attr-verify").value),
    };
    const r = await whileLoading(() => api("POST", "v1/attribution", request), waitingIn(status));
    gradState.attribution = r;
    drawAttribution();
    status.textContent =
      `Metric: clean ${fmt(r.clean.metric)}, corrupted ${fmt(r.corrupted.metric)} ` +
      `(patching everything changes it by ${fmt(r.clean.metric - r.corrupted.metric)}).`;
    status.dataset.state = "done";
  } catch (e) {
    status.textContent = e.message;
    status.dataset.state = "error";
  } finally {
    button.disabled = false;
  }
}

function drawAttribution() {
  const r = gradState.attribution;
  if (!r) return;
  const layers = r.resid_pre.map((_, i) => String(i));
  const positions = r.clean.tokens.map((t, i) => {
    const c = r.corrupted.tokens[i];
    return shorten(t === c ? tokenLabel(t) : `${tokenLabel(t)}/${tokenLabel(c)}`, 14);
  });
  scoreHeatmap($("attr-resid"), r.resid_pre, layers, positions, "hook_resid_pre: layer × position");
  const heads = r.z[0].map((_, h) => `h${h}`);
  scoreHeatmap($("attr-heads"), r.z, layers, heads, "attn.hook_z: layer × head");
  scoreHeatmap(
    $("attr-sublayers"),
    r.attn_out.map((v, i) => [v, r.mlp_out[i]]),
    layers,
    ["attn_out", "mlp_out"],
    "attn_out, mlp_out: layer",
  );
  const table = $("attr-verified");
  table.replaceChildren();
  if (!r.verified.length) return;
  table.createCaption().textContent =
    "The top sites patched for real (the set edit): the linear estimate beside the metric's real change";
  const head = table.createTHead().insertRow();
  for (const name of ["site", "estimate", "real change", "patched metric"]) {
    const th = document.createElement("th");
    th.scope = "col";
    th.textContent = name;
    head.append(th);
  }
  const body = table.createTBody();
  for (const v of r.verified) {
    const row = body.insertRow();
    const s = v.site;
    let where = s.hook;
    if (s.position !== null) where += ` @ ${s.position} (${tokenLabel(r.clean.tokens[s.position])})`;
    if (s.head !== null) where += ` head ${s.head}`;
    row.insertCell().textContent = where;
    row.insertCell().textContent = fmt(v.attribution);
    row.insertCell().textContent = fmt(v.patched_change);
    row.insertCell().textContent = fmt(v.patched_metric);
  }
}

// Blue (positive) – white (0) – red (negative), symmetric about 0.
function diverging(v, bound) {
  const t = Math.max(-1, Math.min(1, bound ? v / bound : 0));
  const far = t >= 0 ? [31, 95, 168] : [198, 40, 40];
  const a = Math.abs(t);
  return far.map((c) => Math.round(255 + (c - 255) * a));
}

function scoreHeatmap(canvas, matrix, rowLabels, colLabels, title) {
  const rows = matrix.length;
  const cols = matrix[0].length;
  const left = 46;
  const top = 26;
  const bottom = 8 + 6.6 * Math.min(14, Math.max(...colLabels.map((s) => s.length)));
  const width = Math.min(canvas.parentElement.clientWidth || 560, 40 + left + 44 * cols);
  const cell = Math.min(44, Math.max(10, (width - left - 10) / cols));
  const rowHeight = Math.min(28, Math.max(12, 240 / rows));
  const ctx = prepare(canvas, Math.max(left + cell * cols + 10, 280), top + rowHeight * rows + bottom);  // room for the title
  const bound = Math.max(...matrix.flat().map(Math.abs)) || 1;
  canvas.dataset.cells = String(rows * cols);
  for (let i = 0; i < rows; i++) {
    for (let j = 0; j < cols; j++) {
      const [r, g, b] = diverging(matrix[i][j], bound);
      ctx.fillStyle = `rgb(${r},${g},${b})`;
      ctx.fillRect(left + j * cell, top + i * rowHeight, cell, rowHeight);
    }
  }
  ctx.strokeStyle = COLORS.axis;
  ctx.strokeRect(left - 0.5, top - 0.5, cell * cols + 1, rowHeight * rows + 1);
  ctx.fillStyle = COLORS.text;
  ctx.font = "600 13px system-ui, sans-serif";
  ctx.textAlign = "left";
  ctx.fillText(`${title} (±${fmt(bound)})`, left, 16);
  ctx.font = "11px ui-monospace, Menlo, Consolas, monospace";
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  rowLabels.forEach((s, i) => ctx.fillText(s, left - 6, top + (i + 0.5) * rowHeight));
  colLabels.forEach((s, j) => {
    ctx.save();
    ctx.translate(left + (j + 0.5) * cell, top + rowHeight * rows + 5);
    ctx.rotate(-Math.PI / 2);
    ctx.fillText(s, 0, 0);
    ctx.restore();
  });
  canvas.title = `${title}: blue raises the metric when the clean value is patched in, red lowers it`;
}

// ---------------------------------------------------------------- wiring

window.addEventListener("DOMContentLoaded", () => {
  $("run-form").addEventListener("submit", runHighway);
  $("attr-run").addEventListener("click", runAttribution);
  $("attr-metric").addEventListener("change", () => {
    const type = $("attr-metric").value;
    $("attr-token-a-label").hidden = type === "loss";
    $("attr-token-b-label").hidden = type !== "logit_diff";
  });
  window.addEventListener("resize", () => {
    drawHighway();
    drawAttribution();
  });
});
