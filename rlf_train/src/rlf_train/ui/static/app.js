// rlf ui: the page. Everything shown from the server (tool outputs, server and tool names, logs, configs) is set
// as text (textContent / attribute values), never parsed as HTML; the server's CSP allows this script only.
"use strict";

const PAGE = (window.crypto && crypto.randomUUID) ? crypto.randomUUID()
  : Array.from({length: 4}, () => Math.random().toString(36).slice(2)).join("");
const $ = (id) => document.getElementById(id);
const state = {
  info: null, sources: [], runs: [], selected: null, base: null,
  metrics: {offset: 0, inode: null, rows: [], run: null}, tasksText: "", previewSeq: 0,
  trials: new Map(),  // "source key|tool" -> {open, args, status, text}: kept when the pool is drawn again
};

class ApiError extends Error {}

async function api(method, path, body) {
  const opt = {method, headers: {"X-RLF-UI": "1", "X-RLF-Page": PAGE}};
  if (body !== undefined) {
    opt.headers["Content-Type"] = "application/json";
    opt.body = JSON.stringify(body);
  }
  let resp;
  try {
    resp = await fetch(path, opt);
  } catch (e) {
    showBanner("the app does not answer (was it stopped?); reload this page once it runs again");
    throw new ApiError("the app does not answer");
  }
  hideBanner();
  let data = null;
  try { data = await resp.json(); } catch (e) { data = {error: `HTTP ${resp.status}`}; }
  if (!resp.ok) throw new ApiError((data && data.error) || `HTTP ${resp.status}`);
  return data;
}

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : String(v));
  }
  for (const kid of kids) if (kid !== null && kid !== undefined) e.append(kid instanceof Node ? kid : String(kid));
  return e;
}

function showBanner(text) { const b = $("banner"); b.textContent = text; b.hidden = false; }
function hideBanner() { $("banner").hidden = true; }
function setError(id, text) { const e = $(id); e.textContent = text || ""; e.hidden = !text; }
function fmt(x, d = 3) { return (typeof x === "number" && isFinite(x)) ? (Math.abs(x) >= 1000 ? x.toFixed(0) : x.toFixed(d)) : "–"; }

async function busy(button, fn) {
  const old = button.textContent;
  button.disabled = true;
  button.textContent = old + " …";
  try { return await fn(); } finally { button.disabled = false; button.textContent = old; }
}

// ------------------------------------------------------------------------------------------------ tabs
function showTab(name) {
  for (const p of document.querySelectorAll(".panel")) p.classList.toggle("active", p.id === `panel-${name}`);
  for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t.dataset.tab === name);
  if (name === "setup") { renderPoolChoices(); preview(); }
}
function route() {
  const h = decodeURIComponent(location.hash.slice(1));
  if (h.startsWith("runs/")) { showTab("runs"); selectRun(h.slice(5)); }
  else showTab(["pool", "setup", "runs"].includes(h) ? h : "pool");
}

// ------------------------------------------------------------------------------------------------ pool
function renderSources() {
  const box = $("sources");
  box.replaceChildren();
  if (!state.sources.length) {
    box.append(el("p", {class: "muted", text: "The pool is empty: add an MCP server or a Python module above."}));
  }
  for (const s of state.sources) box.append(sourceCard(s));
  renderPoolChoices();
}

function skeleton(schema) {
  const out = {};
  const props = (schema && schema.properties) || {};
  for (const [k, p] of Object.entries(props)) {
    const t = Array.isArray(p.type) ? p.type[0] : p.type;
    out[k] = p.enum ? p.enum[0] : t === "integer" || t === "number" ? 0 : t === "boolean" ? false
      : t === "array" ? [] : t === "object" ? {} : "";
  }
  return JSON.stringify(out, null, 1);
}

function sourceCard(s) {
  const key = `${s.kind}:${s.name}`;
  const card = el("div", {class: `card source ${s.status}`, "data-source": key});
  const check = el("button", {class: "small", text: "Check again"});
  check.addEventListener("click", () => busy(check, async () => {
    try { const r = await api("POST", "/api/pool/check", {key}); state.sources = r.sources; renderSources(); }
    catch (e) { setError("pool-error", e.message); }
  }));
  const remove = el("button", {class: "small danger", text: "Remove"});
  remove.addEventListener("click", async () => {
    try { const r = await api("POST", "/api/pool/remove", {key}); state.sources = r.sources; renderSources(); }
    catch (e) { setError("pool-error", e.message); }
  });
  card.append(el("div", {class: "head"},
    el("span", {class: "name", text: s.name}),
    el("span", {class: "badge", text: s.kind === "mcp" ? `MCP · ${s.transport}` : "Python"}),
    el("span", {class: `badge ${s.status}`, text: s.status}),
    el("code", {text: s.target}),
    el("span", {class: "grow"}), check, remove));
  if (s.error) card.append(el("pre", {class: "error", text: s.error}));
  if (s.status === "ok") {
    card.append(el("p", {class: "muted", text: `${s.tools.length} tool(s)` +
      (s.restarts ? ` · restarted ${s.restarts} time(s)` : "")}));
  }
  for (const t of s.tools) card.append(toolRow(key, t));
  return card;
}

function toolRow(key, t) {
  const id = `${key}|${t.name}`;
  const saved = state.trials.get(id) || {open: false, args: skeleton(t.parameters), status: null, text: ""};
  state.trials.set(id, saved);
  const row = el("div", {class: "tool", "data-tool": t.name});
  const args = el("textarea", {rows: 3, spellcheck: "false", class: "trial-args"});
  args.value = saved.args;
  args.addEventListener("input", () => { saved.args = args.value; });
  const out = el("pre", {class: "trial-result", hidden: !saved.status});
  const show = () => {
    out.hidden = !saved.status;
    out.className = `trial-result ${saved.status === "ok" ? "ok" : "error"}`;
    if (saved.status) out.dataset.status = saved.status; else delete out.dataset.status;
    out.textContent = saved.text;
  };
  show();
  const run = el("button", {class: "small primary", text: "Call"});
  run.addEventListener("click", () => busy(run, async () => {
    saved.args = args.value;
    try {
      const r = await api("POST", "/api/pool/try", {key, tool: t.name, arguments: args.value});
      saved.status = r.status;
      saved.text = `[${r.status}, ${(r.latency_s * 1000).toFixed(0)} ms${r.truncated ? ", truncated" : ""}]\n${r.content}`;
    } catch (e) {
      saved.status = "refused";
      saved.text = e.message;
    }
    show();
  }));
  const trial = el("div", {class: "trial", hidden: !saved.open}, args, run);
  const tryBtn = el("button", {class: "small", text: "Try it"});
  tryBtn.addEventListener("click", () => { saved.open = !saved.open; trial.hidden = !saved.open; });
  row.append(el("div", {class: "head"}, el("span", {class: "tname", text: t.name}),
    t.schema_error ? el("span", {class: "badge error", text: "bad schema"}) : null, el("span", {class: "grow"}), tryBtn));
  if (t.description) row.append(el("div", {class: "desc", text: t.description}));
  if (t.schema_error) row.append(el("pre", {class: "error", text: `bad tool schema: ${t.schema_error}`}));
  row.append(el("details", {}, el("summary", {class: "muted", text: "parameters schema"}),
    el("pre", {text: JSON.stringify(t.parameters, null, 2)})));
  row.append(trial, out);
  return row;
}

function lines(text) { return text.split("\n").map((l) => l.trim()).filter(Boolean); }
function pairs(text, sep) {
  const out = {};
  for (const l of lines(text)) {
    const i = l.indexOf(sep);
    if (i <= 0) throw new ApiError(`"${l}": write it as key${sep}value`);
    out[l.slice(0, i).trim()] = l.slice(i + 1).trim();
  }
  return out;
}

async function addServers(body, button) {
  setError("pool-error", "");
  await busy(button, async () => {
    try {
      const r = await api("POST", "/api/pool/servers", body);
      state.sources = r.sources;
      renderSources();
      const bad = r.added.filter((s) => s.status === "error").map((s) => s.name);
      if (bad.length) setError("pool-error", `not added as working: ${bad.join(", ")} (see below)`);
    } catch (e) { setError("pool-error", e.message); }
  });
}

function bindPool() {
  $("add-servers").addEventListener("click", () => addServers({text: $("servers-text").value}, $("add-servers")));
  $("servers-file").addEventListener("change", async (ev) => {
    const f = ev.target.files[0];
    if (f) { $("servers-text").value = await f.text(); ev.target.value = ""; }
  });
  $("add-entry").addEventListener("click", () => {
    let entry;
    try {
      entry = {name: $("srv-name").value.trim(), command: $("srv-command").value.trim(), args: lines($("srv-args").value),
        env: pairs($("srv-env").value, "="), url: $("srv-url").value.trim(), headers: pairs($("srv-headers").value, ":")};
      if ($("srv-timeout").value) entry.timeout = Number($("srv-timeout").value);
    } catch (e) { setError("pool-error", e.message); return; }
    addServers({entry}, $("add-entry"));
  });
  $("add-python").addEventListener("click", () => busy($("add-python"), async () => {
    setError("pool-error", "");
    try {
      const r = await api("POST", "/api/pool/python", {spec: $("python-spec").value});
      state.sources = r.sources;
      renderSources();
      if (r.added.status === "error") setError("pool-error", r.added.error);
    } catch (e) { setError("pool-error", e.message); }
  }));
}

// ------------------------------------------------------------------------------------------------ setup
function renderPoolChoices() {
  const box = $("env-pool-sources");
  const checked = new Set(Array.from(box.querySelectorAll("input:checked")).map((i) => i.value));
  const known = box.dataset.known || "";
  box.replaceChildren();
  if (!state.sources.length) box.append(el("span", {class: "muted", text: "the pool is empty (tab 1)"}));
  for (const s of state.sources) {
    const key = `${s.kind}:${s.name}`;
    const input = el("input", {type: "checkbox", value: key});
    input.checked = checked.has(key) || !known.includes(`|${key}|`);  // a new source is in; one unticked stays out
    input.addEventListener("change", preview);
    box.append(el("label", {}, input, `${s.name} `, el("span", {class: `badge ${s.status}`, text: s.status})));
  }
  box.dataset.known = "|" + state.sources.map((s) => `${s.kind}:${s.name}`).join("|") + "|";
}

function num(id) { const v = $(id).value.trim(); return v === "" ? null : Number(v); }
function radio(name) { const r = document.querySelector(`input[name=${name}]:checked`); return r ? r.value : ""; }

function spec() {
  const poolKeys = Array.from($("env-pool-sources").querySelectorAll("input:checked")).map((i) => i.value);
  return {
    name: $("run-name").value.trim(),
    base: $("base-config").value,
    env: {
      source: radio("env-source"), id: $("env-id").value.trim(), kwargs: $("env-kwargs").value,
      imports: $("env-imports").value.split(",").map((s) => s.trim()).filter(Boolean),
      servers: poolKeys.filter((k) => k.startsWith("mcp:")).map((k) => k.slice(4)),
      python_tools: poolKeys.filter((k) => k.startsWith("python:")).map((k) => k.slice(7)),
      tasks_path: $("env-tasks-path").value.trim(), tasks_text: state.tasksText, format: $("env-format").value,
    },
    reward: {
      kind: $("reward-kind").value, base_url: $("reward-base-url").value, model: $("reward-model").value,
      api_key_env: $("reward-api-key-env").value, rubric: $("reward-rubric").value, tool: $("reward-tool").value,
      arguments: $("reward-arguments").value, expect: $("reward-expect").value, pattern: $("reward-pattern").value,
      yaml: $("reward-yaml").value,
    },
    model: {
      kind: $("model-kind").value, path: $("model-path").value.trim(), device: $("model-device").value.trim(),
      dtype: $("model-dtype").value, hidden_size: num("model-hidden"), num_layers: num("model-layers"),
    },
    training: {
      steps: num("t-steps"), sft: $("t-sft").value, sft_steps: num("t-sft-steps"), sft_demos_path: $("t-sft-demos").value.trim(),
      prompts_per_step: num("t-prompts"), samples_per_prompt: num("t-samples"), eval_every: num("t-eval-every"),
      eval_num_tasks: num("t-eval-tasks"), save_every: num("t-save-every"), seed: num("t-seed"),
    },
    overrides: $("overrides").value,
  };
}

function showWhen() {
  const env = radio("env-source"), reward = $("reward-kind").value, model = $("model-kind").value;
  for (const e of document.querySelectorAll("[data-when-env]")) e.hidden = e.dataset.whenEnv !== env;
  for (const e of document.querySelectorAll("[data-when-reward]")) e.hidden = !e.dataset.whenReward.split(" ").includes(reward);
  for (const e of document.querySelectorAll("[data-when-model]")) e.hidden = e.dataset.whenModel !== model;
}

let previewTimer = null;
function preview() {
  showWhen();
  clearTimeout(previewTimer);
  previewTimer = setTimeout(doPreview, 250);
}

async function doPreview() {
  const seq = ++state.previewSeq;
  const s = spec();
  try {
    const c = await api("POST", "/api/config/preview", s);
    if (seq !== state.previewSeq) return;
    renderComposed(c);
  } catch (e) {
    if (seq !== state.previewSeq) return;
    renderComposed({ok: false, error: e.message, yaml: "", plan: "", command: ""});
  }
}

function renderComposed(c) {
  setError("config-error", c.error);
  const badge = $("config-state");
  badge.className = `badge ${c.ok ? "ok" : "error"}`;
  badge.textContent = c.ok ? "valid" : "invalid";
  $("config-yaml").textContent = c.yaml || "";
  $("config-plan").textContent = c.plan || "";
  $("config-command").textContent = c.command || "";
  $("start-run").disabled = !c.ok;
}

async function loadBase() {
  const path = $("base-config").value;
  const about = (state.info.configs.find((c) => c.path === path) || {}).about || "";
  $("base-about").textContent = path ? about : "rlf_train's defaults (rlf/Search-v0, tiny model)";
  try {
    const b = await api("GET", `/api/config/base?path=${encodeURIComponent(path)}`);
    state.base = b;
    $("env-config-about").textContent = `${b.env_id}` + (b.env_kwargs ? ` with kwargs:\n${b.env_kwargs}` : "");
    const ph = {"t-steps": b.steps, "t-sft-steps": b.sft_steps, "t-prompts": b.prompts_per_step,
      "t-samples": b.samples_per_prompt, "t-eval-every": b.eval_every, "t-eval-tasks": b.eval_num_tasks,
      "t-save-every": b.save_every, "t-seed": b.seed, "model-hidden": b.hidden_size, "model-layers": b.num_layers,
      "model-device": b.device};
    for (const [id, v] of Object.entries(ph)) $(id).placeholder = `${v} (config)`;
    $("t-sft").options[0].textContent = `(config: ${b.sft ? "on" : "off"})`;
    $("model-kind").options[0].textContent = `the base config's (${b.model})`;
    if (!$("run-name").dataset.touched) $("run-name").value = uniqueName(b.name);
  } catch (e) {
    state.base = null;
    $("env-config-about").textContent = "";
  }
  preview();
}

function uniqueName(base) {
  const taken = new Set(state.runs.map((r) => r.name));
  for (let i = 1; ; i++) { const n = `${base}-${i}`; if (!taken.has(n)) return n; }
}

function bindSetup() {
  const panel = $("panel-setup");
  panel.addEventListener("input", preview);
  panel.addEventListener("change", preview);
  $("run-name").addEventListener("input", () => { $("run-name").dataset.touched = "1"; });
  $("base-config").addEventListener("change", loadBase);
  $("env-tasks-file").addEventListener("change", async (ev) => {
    const f = ev.target.files[0];
    state.tasksText = f ? await f.text() : "";
    $("env-tasks-uploaded").textContent = f ? `uploaded: ${f.name} (${state.tasksText.split("\n").filter(Boolean).length} lines); it goes into the run dir` : "";
    preview();
  });
  $("dry-run").addEventListener("click", () => busy($("dry-run"), async () => {
    const out = $("dry-run-result");
    out.hidden = false;
    out.className = "";
    out.textContent = "running python -m rlf_train --dry-run …";
    try {
      const r = await api("POST", "/api/config/check", spec());
      renderComposed(r.composed);
      const d = r.dry_run;
      if (!d) { out.className = "error"; out.dataset.ok = "0"; out.textContent = r.composed.error; return; }
      out.dataset.ok = d.ok ? "1" : "0";
      out.className = d.ok ? "ok" : "error";
      out.textContent = d.ok ? `dry run passed (${d.seconds.toFixed(1)} s): ${d.command}\n\n${d.output.split("plan:")[1] ? "plan:" + d.output.split("plan:")[1] : d.output}`
        : `dry run failed (${d.seconds.toFixed(1)} s): ${d.command}\n\nerror: ${d.error}`;
    } catch (e) { out.className = "error"; out.dataset.ok = "0"; out.textContent = e.message; }
  }));
  $("start-run").addEventListener("click", () => busy($("start-run"), async () => {
    try {
      const s = spec();
      const v = await api("POST", "/api/runs", s);
      $("run-name").dataset.touched = "";
      await refreshRuns();
      $("run-name").value = uniqueName(state.base ? state.base.name : "run");
      location.hash = `runs/${encodeURIComponent(v.name)}`;
    } catch (e) { setError("config-error", e.message); }
  }));
}

// ------------------------------------------------------------------------------------------------ runs
async function refreshRuns() {
  const r = await api("GET", "/api/runs");
  state.runs = r.runs;
  const body = $("runs-list");
  body.replaceChildren();
  if (!r.runs.length) body.append(el("tr", {}, el("td", {colspan: 4, class: "muted", text: "no runs yet: set one up in tab 2"})));
  for (const v of r.runs) {
    const p = v.progress;
    const rl = p.rl_step > 0 || p.stage !== "SFT";
    const share = rl ? (p.rl_steps ? p.rl_step / p.rl_steps : 0) : (p.total ? p.done / p.total : 0);
    const where = rl ? `RL ${p.rl_step}/${p.rl_steps}` : `SFT ${p.done}/${p.total}`;
    const tr = el("tr", {"data-run": v.name, class: v.name === state.selected ? "selected" : ""},
      el("td", {text: v.name}), el("td", {}, el("span", {class: `badge ${v.state}`, text: v.state})),
      el("td", {}, el("span", {class: "minibar"}, bar(share)), where),
      el("td", {class: "muted", text: v.checkpoint ? `checkpoint ${v.checkpoint}` : ""}));
    tr.addEventListener("click", () => { location.hash = `runs/${encodeURIComponent(v.name)}`; });
    body.append(tr);
  }
}
function bar(share) { const s = el("span"); s.style.width = `${Math.round(Math.max(0, Math.min(1, share)) * 100)}%`; return s; }

function selectRun(name) {
  if (state.selected !== name) {
    state.selected = name;
    state.metrics = {offset: 0, inode: null, rows: [], run: name};
    $("viewer-frame").removeAttribute("src");
    $("viewer-details").open = false;
  }
  $("run-detail").hidden = false;
  pollRun();
}

async function pollRun() {
  const name = state.selected;
  if (!name) return;
  const m = state.metrics;
  let d;
  try {
    d = await api("GET", `/api/runs/${encodeURIComponent(name)}?offset=${m.offset}` + (m.inode ? `&inode=${m.inode}` : ""));
  } catch (e) { setError("run-error", e.message); return; }
  if (state.selected !== name) return;
  if (d.metrics.reset) m.rows = [];
  m.rows.push(...d.metrics.rows);
  m.offset = d.metrics.offset;
  m.inode = d.inode;
  renderRun(d);
}

function renderRun(d) {
  const v = d.run;
  $("run-title").textContent = v.name;
  const badge = $("run-state");
  badge.className = `badge ${v.state}`;
  badge.textContent = v.state + (v.rc !== null && v.rc !== undefined ? ` (exit ${v.rc})` : "");
  $("run-stop").disabled = !(v.state === "running");
  $("run-resume").disabled = !v.resumable;
  $("run-command").textContent = v.command;
  const link = $("run-viewer-link");
  link.href = `/runs/${encodeURIComponent(v.name)}/viewer`;
  setError("run-error", v.error);
  const rows = state.metrics.rows;
  const rl = rows.filter((r) => r.stage === "rl");
  const ev = rows.filter((r) => r.stage === "eval");
  const p = v.progress;
  const lastRl = rl.length ? rl[rl.length - 1].step : 0;
  let share = p.rl_steps ? lastRl / p.rl_steps : 0;
  let text = `RL step ${lastRl} of ${p.rl_steps}`;
  if (p.stage === "SFT" && !rl.length) {
    share = p.total ? p.done / p.total : 0;
    text = `SFT warm start ${p.done} of ${p.total}, then ${p.rl_steps} RL steps`;
  }
  if (p.line && (p.stage !== "SFT" || !rl.length)) text += ` · ${p.line}`;
  $("run-bar").style.width = `${Math.round(Math.min(1, share) * 100)}%`;
  $("run-progress").textContent = text + (v.checkpoint ? ` · latest checkpoint: ${v.checkpoint}` : "");
  const last = rl[rl.length - 1] || {};
  chart("chart-reward", "legend-reward", [
    {label: "reward_mean", color: "#2f6fde", pts: rl.filter((r) => "reward_mean" in r).map((r) => [r.step, r.reward_mean])},
    {label: "success_rate", color: "#1f8a4c", pts: rl.filter((r) => "success_rate" in r).map((r) => [r.step, r.success_rate])},
  ]);
  const evKeys = Array.from(new Set(ev.flatMap((r) => Object.keys(r).filter((k) => k.startsWith("success_"))))).sort();
  const colors = ["#1f8a4c", "#d97706", "#7c3aed", "#db2777"];
  chart("chart-eval", "legend-eval", evKeys.map((k, i) => ({label: k, color: colors[i % colors.length],
    pts: ev.filter((r) => k in r).map((r) => [r.step, r[k]])})));
  chart("chart-tools", "legend-tools", [
    {label: "tool_calls_mean", color: "#2f6fde", pts: rl.filter((r) => "tool_calls_mean" in r).map((r) => [r.step, r.tool_calls_mean])},
    {label: "tool_errors_mean", color: "#c23a3a", pts: rl.filter((r) => "tool_errors_mean" in r).map((r) => [r.step, r.tool_errors_mean])},
    {label: "invalid_turns_mean", color: "#b7791f", pts: rl.filter((r) => "invalid_turns_mean" in r).map((r) => [r.step, r.invalid_turns_mean])},
  ]);
  const ts = d.tool_stats;
  const tb = $("tool-stats");
  tb.replaceChildren();
  for (const t of ts.tools) {
    const failed = Object.entries(t.failed).map(([k, n]) => `${k} ${n}`).join(", ");
    tb.append(el("tr", {"data-tool": t.tool}, el("td", {}, el("code", {text: t.tool})), el("td", {text: t.calls}),
      el("td", {text: t.ok}), el("td", {text: failed || "0"}), el("td", {text: `${(t.latency_mean_s * 1000).toFixed(1)} ms`})));
  }
  $("tool-stats-note").textContent = `${ts.episodes} stored training episode(s) over step(s) ${ts.steps.join(", ") || "–"}` +
    (rl.length ? ` · last step: ${fmt(last.tool_calls_mean, 2)} calls, ${fmt(last.tool_errors_mean, 2)} errors, ` +
      `${fmt(last.unknown_tool_calls_mean, 2)} unknown-tool calls per episode` : "") +
    (ts.tools.length ? "" : " (no tool call yet)");
  const log = $("run-log");
  const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
  log.textContent = d.log;
  if (atEnd) log.scrollTop = log.scrollHeight;
}

function chart(svgId, legendId, series) {
  const svg = $(svgId);
  const NS = "http://www.w3.org/2000/svg";
  const mk = (tag, attrs, text) => {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
    if (text !== undefined) e.textContent = text;
    return e;
  };
  svg.replaceChildren();
  const W = 420, H = 200, L = 40, R = 10, T = 10, B = 24;
  const all = series.flatMap((s) => s.pts).filter((p) => isFinite(p[0]) && isFinite(p[1]));
  svg.dataset.n = String(all.length);
  const legend = $(legendId);
  legend.replaceChildren();
  if (!all.length) {
    svg.append(mk("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"}, "no data yet"));
    return;
  }
  let x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(...all.map((p) => p[0]));
  let y0 = Math.min(0, ...all.map((p) => p[1])), y1 = Math.max(1, ...all.map((p) => p[1]));
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) y1 = y0 + 1;
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = (y) => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  svg.append(mk("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis"}));
  svg.append(mk("line", {x1: L, y1: T, x2: L, y2: H - B, class: "axis"}));
  for (const y of [y0, (y0 + y1) / 2, y1]) {
    svg.append(mk("text", {x: L - 4, y: sy(y) + 3, "text-anchor": "end", class: "tick"}, fmt(y, 2)));
  }
  for (const x of [x0, x1]) svg.append(mk("text", {x: sx(x), y: H - 8, "text-anchor": "middle", class: "tick"}, String(x)));
  for (const s of series) {
    const pts = s.pts.filter((p) => isFinite(p[0]) && isFinite(p[1]));
    if (!pts.length) continue;
    svg.append(mk("polyline", {points: pts.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" "),
      fill: "none", stroke: s.color, "stroke-width": 1.8, "data-series": s.label, "data-n": pts.length}));
    if (pts.length <= 40) for (const p of pts) svg.append(mk("circle", {cx: sx(p[0]).toFixed(1), cy: sy(p[1]).toFixed(1), r: 2.2, fill: s.color}));
    const sw = el("i");
    sw.style.background = s.color;
    legend.append(el("span", {}, sw, `${s.label} ${fmt(pts[pts.length - 1][1], 3)}`));
  }
}

function bindRuns() {
  $("run-stop").addEventListener("click", () => busy($("run-stop"), async () => {
    try { await api("POST", `/api/runs/${encodeURIComponent(state.selected)}/stop`, {}); await pollRun(); await refreshRuns(); }
    catch (e) { setError("run-error", e.message); }
  }));
  $("run-resume").addEventListener("click", () => busy($("run-resume"), async () => {
    try {
      const steps = $("resume-steps").value.trim();
      await api("POST", `/api/runs/${encodeURIComponent(state.selected)}/resume`, {steps: steps === "" ? null : Number(steps)});
      await pollRun();
      await refreshRuns();
    } catch (e) { setError("run-error", e.message); }
  }));
  $("viewer-details").addEventListener("toggle", () => {
    if ($("viewer-details").open) $("viewer-frame").src = `/runs/${encodeURIComponent(state.selected)}/viewer`;
  });
}

// ------------------------------------------------------------------------------------------------ start
async function init() {
  bindPool();
  bindSetup();
  bindRuns();
  $("shutdown").addEventListener("click", async () => {
    if (!confirm("Stop every run this app started, close its MCP servers and exit the app?")) return;
    try { await api("POST", "/api/shutdown", {}); } catch (e) { /* it is going away */ }
    showBanner("the app is shutting down: its runs are stopped (checkpoints kept) and its servers closed");
  });
  window.addEventListener("hashchange", route);
  window.addEventListener("pagehide", () => {
    fetch("/api/bye", {method: "POST", keepalive: true, headers: {"X-RLF-UI": "1", "X-RLF-Page": PAGE}}).catch(() => {});
  });
  state.info = await api("GET", "/api/state");
  await api("POST", "/api/hello", {});
  $("app-status").textContent = `runs in ${state.info.runs_dir}` + (state.info.keep_runs ? ""
    : " · closing the last page of this app stops its runs (checkpoints are kept)");
  $("runs-dir").textContent = state.info.runs_dir;
  const base = $("base-config");
  base.append(el("option", {value: "", text: "(rlf_train's defaults)"}));
  for (const c of state.info.configs) base.append(el("option", {value: c.path, text: c.path}));
  const quick = state.info.configs.find((c) => c.path === "configs/quickstart.yaml");
  if (quick) base.value = quick.path;
  const ids = $("env-ids");
  for (const id of state.info.envs) ids.append(el("option", {value: id}));
  const pool = await api("GET", "/api/pool");
  state.sources = pool.sources;
  renderSources();
  await refreshRuns();
  await loadBase();
  route();
  setInterval(() => { refreshRuns().catch(() => {}); }, 2000);
  setInterval(() => { if (state.selected && $("panel-runs").classList.contains("active")) pollRun(); }, 1500);
  document.body.dataset.ready = "1";
}

document.addEventListener("DOMContentLoaded", () => {
  init().catch((e) => { showBanner(`the page could not start: ${e.message}`); });
});
