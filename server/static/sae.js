// The viewer's SAE panel: per token, an SAE's top features (POST /v1/features), and a steering control
// that regenerates the steered text beside the unsteered one (POST /v1/generate with a steer edit). It
// uses app.js's `api` (the API key field) and the main form's prompt and max new tokens; it is shown
// only when the server loaded SAEs or holds steering vectors (GET /v1/model).
"use strict";

const sae = {
  saes: [], // /v1/model's saes
  vectors: [], // /v1/model's steering_vectors
  features: new Runs(), // the feature table's requests: a newer one, or a run of the page, supersedes them
  steering: new Runs(), // the steering comparison's: a newer strength supersedes the one on its way
};

function saeById(id) {
  return sae.saes.find((s) => s.id === id);
}

// The options of `select`, the one chosen kept where it is still among them (the panel is filled again on
// every run: a user's choice of SAE must survive it, or a steer would name one SAE at another's hook).
function fillOptions(select, values, label) {
  const chosen = select.value;
  select.replaceChildren();
  for (const v of values) {
    const o = document.createElement("option");
    o.value = v;
    o.textContent = label ? label(v) : v;
    select.append(o);
  }
  if (values.includes(chosen)) select.value = chosen;
}

async function loadSaePanel() {
  const m = await api("GET", "v1/model");
  sae.saes = m.saes || [];
  sae.vectors = m.steering_vectors || [];
  $("sae-panel").hidden = sae.saes.length === 0 && sae.vectors.length === 0;
  fillOptions($("sae-select"), sae.saes.map((s) => s.id), (id) => `${id} (${saeById(id).hook_name}, ${saeById(id).d_sae})`);
  fillOptions($("steer-vector"), sae.vectors);
  if (!$("steer-hook").value && sae.saes.length) $("steer-hook").value = sae.saes[0].hook_name;
  if (!sae.saes.length) document.querySelector('input[name="steer-source"][value="vector"]').checked = true;
}

async function showFeatures() {
  const { signal, current } = sae.features.start();
  const id = $("sae-select").value;
  $("sae-table").replaceChildren(); // a failure leaves no other prompt's features
  $("sae-status").textContent = "Reading features…";
  try {
    const request = { prompt: $("prompt").value, sae: id, top_k: Number($("sae-top-k").value) };
    const body = await whileLoading(() => api("POST", "v1/features", request, { signal }));
    if (!current()) return;
    renderFeatures(body);
    $("sae-status").textContent = `${body.tokens.length} tokens · SAE ${id} at ${body.hook_name}`;
  } catch (e) {
    if (current()) $("sae-status").textContent = e.message; // else superseded: the newer request reports
  }
}

function renderFeatures(body) {
  const table = $("sae-table");
  table.replaceChildren();
  const head = table.createTHead().insertRow();
  for (const h of ["pos", "token", "top features (id: value)", "L0", "var. expl."]) {
    const th = document.createElement("th");
    th.textContent = h;
    head.append(th);
  }
  const rows = table.createTBody();
  body.features.forEach((f, i) => {
    const tr = rows.insertRow();
    tr.insertCell().textContent = String(i);
    tr.insertCell().textContent = JSON.stringify(body.tokens[i]);
    const cell = tr.insertCell();
    cell.className = "features";
    for (const { id, value } of f.features) {
      const b = document.createElement("button");
      b.type = "button";
      b.className = "feature";
      b.dataset.feature = String(id);
      b.textContent = `${id}: ${value.toFixed(2)}`;
      b.title = "steer with this feature";
      b.addEventListener("click", () => chooseFeature(body.sae, id));
      cell.append(b);
    }
    tr.insertCell().textContent = String(f.l0);
    tr.insertCell().textContent = f.variance_explained === null ? "–" : f.variance_explained.toFixed(3);
  });
}

function chooseFeature(id, feature) {
  document.querySelector('input[name="steer-source"][value="feature"]').checked = true;
  $("sae-select").value = id;
  $("steer-feature").value = String(feature);
  $("steer-hook").value = saeById(id).hook_name;
  steer();
}

function steeringEdit() {
  const source = document.querySelector('input[name="steer-source"]:checked').value;
  const direction =
    source === "vector"
      ? { vector: $("steer-vector").value }
      : { sae: $("sae-select").value, feature: Number($("steer-feature").value) };
  return {
    hook: $("steer-hook").value.trim(),
    op: "steer",
    scale: Number($("steer-strength").value),
    direction,
    norm_match: $("steer-norm-match").checked,
  };
}

async function steer() {
  const { signal, current } = sae.steering.start();
  const body = {
    prompt: $("prompt").value,
    max_new_tokens: Number($("max-new-tokens").value),
    temperature: 0,
  };
  $("steer-plain").textContent = "…";
  $("steer-steered").textContent = "…";
  try {
    const [plain, steered] = await Promise.all([
      whileLoading(() => api("POST", "v1/generate", body, { signal })),
      whileLoading(() => api("POST", "v1/generate", { ...body, interventions: [steeringEdit()] }, { signal })),
    ]);
    if (!current()) return; // a newer strength is on its way
    $("steer-plain").textContent = body.prompt + plain.choices[0].text;
    $("steer-steered").textContent = body.prompt + steered.choices[0].text;
  } catch (e) {
    if (!current()) return;
    sae.steering.stop(); // the other side's request, still running or waiting for the model: no one reads it
    $("steer-plain").textContent = ""; // no comparison: neither side of an earlier one stays
    $("steer-steered").textContent = e.message;
  }
}

window.addEventListener("DOMContentLoaded", () => {
  whileLoading(loadSaePanel).catch((e) => {
    $("sae-status").textContent = e.message;
  });
  $("run-form").addEventListener("submit", () => {
    // the features shown, or on their way, are the last prompt's: read again for this one
    sae.features.stop();
    $("sae-table").replaceChildren();
    $("sae-status").textContent = "";
    // with the API key, if one is needed, once the model is loaded (the run reports any other failure)
    whileLoading(loadSaePanel).catch(() => {});
  });
  // a steer names the SAE chosen at that SAE's own hook
  $("sae-select").addEventListener("change", () => {
    const s = saeById($("sae-select").value);
    if (s) $("steer-hook").value = s.hook_name;
  });
  $("sae-run").addEventListener("click", showFeatures);
  $("steer-run").addEventListener("click", steer);
  const regenerate = debounce(steer, 250);
  $("steer-strength").addEventListener("input", () => {
    $("steer-strength-value").textContent = $("steer-strength").value;
    regenerate();
  });
});
