// rlf trajectory viewer. All data is policy/tool output: it only ever becomes text nodes or attribute
// values (never innerHTML). State lives in location.hash so views can be reloaded and shared.
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("rlf-data").textContent);
  var EPISODES = DATA.episodes || [];
  var SVGNS = "http://www.w3.org/2000/svg";
  var FILTERS = [
    ["all", "all"], ["success", "success"], ["failed", "failed"],
    ["tool_errors", "tool errors"], ["truncated", "truncated"]
  ];

  function el(tag, attrs) {
    var node = document.createElement(tag);
    if (attrs) for (var k in attrs) if (Object.prototype.hasOwnProperty.call(attrs, k)) node.setAttribute(k, String(attrs[k]));
    for (var i = 2; i < arguments.length; i++) {
      var c = arguments[i];
      if (c === null || c === undefined) continue;
      node.appendChild(typeof c === "object" ? c : document.createTextNode(String(c)));
    }
    return node;
  }
  function svg(tag, attrs) {
    var node = document.createElementNS(SVGNS, tag);
    for (var k in attrs) if (Object.prototype.hasOwnProperty.call(attrs, k)) node.setAttribute(k, String(attrs[k]));
    return node;
  }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); return node; }
  function fmt(x) { return typeof x === "number" ? (Math.round(x * 1000) / 1000).toString() : String(x); }
  function uniq(xs) { var s = {}, out = []; xs.forEach(function (x) { if (!s[x]) { s[x] = 1; out.push(x); } }); return out; }
  function numSort(a, b) { return a - b; }
  // "1 step", "2 steps"
  function count(n, noun) { return n + " " + noun + (n === 1 ? "" : "s"); }

  // ---------------------------------------------------------------- state (the URL fragment)
  function readState() {
    var st = {};
    (location.hash || "").replace(/^#/, "").split("&").forEach(function (kv) {
      if (!kv) return;
      var i = kv.indexOf("=");
      var k = i < 0 ? kv : kv.slice(0, i), v = i < 0 ? "" : kv.slice(i + 1);
      try { st[decodeURIComponent(k)] = decodeURIComponent(v); } catch (e) { /* a malformed fragment: ignore */ }
    });
    return st;
  }
  function setState(patch) {
    var st = readState();
    for (var k in patch) if (Object.prototype.hasOwnProperty.call(patch, k)) {
      if (patch[k] === null || patch[k] === "") delete st[k]; else st[k] = String(patch[k]);
    }
    var parts = [];
    for (var key in st) if (Object.prototype.hasOwnProperty.call(st, key)) parts.push(encodeURIComponent(key) + "=" + encodeURIComponent(st[key]));
    location.hash = parts.join("&");  // fires hashchange -> render()
  }

  // ---------------------------------------------------------------- filters
  function isTruncated(ep) { return ep.end_reason === "max_turns" || ep.end_reason === "token_budget"; }
  function hasToolErrors(ep) {
    return ep.tool_errors > 0 || ep.error !== null && ep.error !== undefined ||
      ep.turns.some(function (t) { return t.kind === "invalid"; });
  }
  function passes(ep, filter, task) {
    if (filter === "success" && !ep.success) return false;
    if (filter === "failed" && ep.success) return false;
    if (filter === "tool_errors" && !hasToolErrors(ep)) return false;
    if (filter === "truncated" && !isTruncated(ep)) return false;
    if (task) {
      var t = task.toLowerCase();
      if (ep.task.id.toLowerCase() !== t && ep.task.question.toLowerCase().indexOf(t) < 0) return false;
    }
    return true;
  }
  function allSteps() { return uniq(EPISODES.map(function (e) { return e.step; })).sort(numSort); }
  function sourcesAt(step) {
    return uniq(EPISODES.filter(function (e) { return e.step === step; }).map(function (e) { return e.source; })).sort();
  }
  function resolve(st) {
    var steps = allSteps();
    var step = st.step !== undefined && steps.indexOf(Number(st.step)) >= 0 ? Number(st.step) : steps[steps.length - 1];
    var sources = sourcesAt(step);
    var source = st.source === "*" || sources.indexOf(st.source) >= 0 ? st.source :
      (sources.indexOf("eval_greedy") >= 0 ? "eval_greedy" : sources[0]);
    var filter = FILTERS.some(function (f) { return f[0] === st.filter; }) ? st.filter : "all";
    return { steps: steps, step: step, sources: sources, source: source, filter: filter, task: st.task || "" };
  }

  // ---------------------------------------------------------------- curves
  function chart(title, series, width, height) {
    var box = el("div", { "class": "chart" }, el("h3", null, title));
    var pts = [];
    series.forEach(function (s) { s.points.forEach(function (p) { pts.push(p); }); });
    if (!pts.length) return null;
    var xs = pts.map(function (p) { return p[0]; }), ys = pts.map(function (p) { return p[1]; });
    var x0 = Math.min.apply(null, xs), x1 = Math.max.apply(null, xs);
    var y0 = Math.min(0, Math.min.apply(null, ys)), y1 = Math.max(1, Math.max.apply(null, ys));
    if (x1 === x0) x1 = x0 + 1;
    var L = 34, B = 18, W = width, H = height;
    function X(x) { return L + (x - x0) / (x1 - x0) * (W - L - 6); }
    function Y(y) { return (H - B) - (y - y0) / (y1 - y0) * (H - B - 6); }
    var g = svg("svg", { width: W, height: H, viewBox: "0 0 " + W + " " + H, role: "img" });
    g.appendChild(svg("line", { x1: L, y1: H - B, x2: W - 4, y2: H - B, stroke: "#9aa5b4" }));
    g.appendChild(svg("line", { x1: L, y1: 4, x2: L, y2: H - B, stroke: "#9aa5b4" }));
    [[y0, H - B], [y1, 10]].forEach(function (t) {
      var tx = svg("text", { x: 2, y: t[1], "font-size": 10, fill: "#4b5563" }); tx.textContent = fmt(t[0]); g.appendChild(tx);
    });
    [[x0, L, "start"], [x1, W - 4, "end"]].forEach(function (t) {
      var tx = svg("text", { x: t[1], y: H - 4, "font-size": 10, fill: "#4b5563", "text-anchor": t[2] });
      tx.textContent = "step " + fmt(t[0]);
      g.appendChild(tx);
    });
    var legend = el("div", { "class": "legend" });
    series.forEach(function (s) {
      if (!s.points.length) return;
      var d = s.points.map(function (p, i) { return (i ? "L" : "M") + X(p[0]).toFixed(1) + " " + Y(p[1]).toFixed(1); }).join(" ");
      g.appendChild(svg("path", { d: d, fill: "none", stroke: s.color, "stroke-width": s.dots ? 1.5 : 1.2, "stroke-dasharray": s.dots ? "4 3" : "" }));
      if (s.dots) s.points.forEach(function (p) { g.appendChild(svg("circle", { cx: X(p[0]), cy: Y(p[1]), r: 3, fill: s.color })); });
      legend.appendChild(el("span", { style: "--c:" + s.color }, s.label));
    });
    box.appendChild(g);
    box.appendChild(legend);
    return box;
  }
  function renderCurves() {
    var m = DATA.metrics || { rl: [], eval: [] };
    function series(rows, key, label, color, dots) {
      return { label: label, color: color, dots: dots, points: rows.filter(function (r) { return typeof r[key] === "number"; })
        .map(function (r) { return [r.step, r[key]]; }) };
    }
    var box = clear(document.getElementById("curves"));
    var charts = [
      chart("reward", [series(m.rl, "reward_mean", "train reward (mean per step)", "#2f6fde", false),
                       series(m.eval, "reward_greedy", "held-out reward, greedy", "#157f3b", true),
                       series(m.eval, "reward_api", "reward (API eval)", "#157f3b", true)], 460, 170),
      chart("success", [series(m.rl, "success_rate", "train success", "#2f6fde", false),
                        series(m.rl, "search_rate", "train: episodes with a tool call", "#9a8f6b", false),
                        series(m.eval, "success_greedy", "held-out success, greedy", "#157f3b", true),
                        series(m.eval, "success_sampled", "held-out success, sampled", "#d9822b", true),
                        series(m.eval, "success_api", "success (API eval)", "#157f3b", true)], 460, 170),
      // a group judge's cost (group_reward): tokens per step and seconds per call
      chart("judge cost", [series(m.rl, "group_judge/tokens_in", "judge tokens in (per step)", "#6b4fbb", false),
                           series(m.rl, "group_judge/tokens_out", "judge tokens out (per step)", "#b04f8f", false)],
            460, 170),
      chart("judge seconds", [series(m.rl, "group_judge/seconds_per_call", "seconds per judge call", "#6b4fbb", false)],
            460, 170)
    ];
    charts.forEach(function (c) { if (c) box.appendChild(c); });
  }

  // ---------------------------------------------------------------- list
  function select(id, options, value, onchange) {
    var s = el("select", { id: id });
    options.forEach(function (o) {
      var opt = el("option", { value: o[0] }, o[1]);
      if (String(o[0]) === String(value)) opt.selected = true;
      s.appendChild(opt);
    });
    s.addEventListener("change", function () { onchange(s.value); });
    return s;
  }
  function renderControls(r) {
    var c = clear(document.getElementById("controls"));
    c.appendChild(el("label", null, "step ", select("step-select", r.steps.map(function (s) { return [s, String(s)]; }), r.step,
      function (v) { setState({ step: v, ep: null }); })));
    c.appendChild(el("label", null, "source ", select("source-select",
      [["*", "all sources"]].concat(r.sources.map(function (s) { return [s, s]; })), r.source,
      function (v) { setState({ source: v, ep: null }); })));
    var fb = el("span", { "class": "filters" });
    FILTERS.forEach(function (f) {
      var b = el("button", { type: "button", "data-filter": f[0], "class": f[0] === r.filter ? "on" : "" }, f[1]);
      b.addEventListener("click", function () { setState({ filter: f[0] === "all" ? null : f[0], ep: null }); });
      fb.appendChild(b);
    });
    c.appendChild(fb);
    var t = el("input", { id: "task-filter", type: "search", placeholder: "task id or words of the question", size: 24 });
    t.value = r.task;
    t.addEventListener("change", function () { setState({ task: t.value, ep: null }); });
    c.appendChild(el("label", null, "task ", t));
  }
  function visible(r) {
    return EPISODES.filter(function (e) {
      return e.step === r.step && (r.source === "*" || e.source === r.source) && passes(e, r.filter, r.task);
    });
  }
  function renderList(r, eps, selKey) {
    var body = clear(document.querySelector("#episodes tbody"));
    if (!eps.length) {
      body.appendChild(el("tr", { "class": "none" }, el("td", { colspan: 7, "class": "empty" }, "no episodes match")));
      return;
    }
    eps.forEach(function (e) {
      var cls = (e.success ? "ok" : "bad") + (e.key === selKey ? " sel" : "");
      var row = el("tr", { "data-key": e.key, "data-task": e.task.id, "class": cls },
        el("td", null, (r.source === "*" ? e.source + " " : "") + e.index), el("td", null, e.task.id),
        el("td", { "class": "q", title: e.task.question }, e.task.question), el("td", null, fmt(e.reward)),
        el("td", null, e.turns.length), el("td", null, e.tool_calls + (e.tool_errors ? " (" + e.tool_errors + " err)" : "")),
        el("td", null, e.end_reason));
      row.addEventListener("click", function () { setState({ ep: e.key }); });
      body.appendChild(row);
    });
  }

  // ---------------------------------------------------------------- one episode as a chat
  function tokInfo(t, what) {
    if (!t) return null;
    return el("span", { "class": "tok" }, count(t.tokens, "token") + ", loss mask " + (t.trained === t.tokens ? "1" : t.trained ? "mixed" : "0") +
      (what ? " (" + what + ")" : ""));
  }
  function message(cls, who, text, info) {
    // whitespace-only text (common for an untrained policy) is shown escaped, so the turn is not blank
    var shown = text.trim() === "" ? "(only whitespace: " + JSON.stringify(text) + ")" : text;
    return el("div", { "class": "msg " + cls }, el("div", { "class": "who" }, who, info), el("pre", null, shown));
  }
  function maskBar(ep) {
    var runs = ep.mask_runs || [];
    if (!runs.length) return null;
    var total = runs[runs.length - 1][1] || 1;
    var bar = el("div", { "class": "maskbar", title: "loss mask over the episode's tokens: blue = policy (1), beige = prompt/observation (0)" });
    runs.forEach(function (r) {
      bar.appendChild(el("div", { "class": "m" + r[2], style: "width:" + (100 * (r[1] - r[0]) / total).toFixed(3) + "%" }));
    });
    return bar;
  }
  function episodeCard(ep, heading) {
    var card = el("div", { "class": "episode", "data-key": ep.key });
    card.appendChild(el("h2", null, heading || ("step " + ep.step + " · " + ep.source + " #" + ep.index),
      el("span", { "class": "badge " + (ep.success ? "ok" : "bad") }, ep.success ? "success" : "failed"),
      el("span", { "class": "badge" }, "reward " + fmt(ep.reward)), el("span", { "class": "badge" }, ep.end_reason)));
    card.appendChild(el("div", { "class": "meta" }, "task " + ep.task.id + (ep.task.gold === null ? "" : " · gold " + ep.task.gold) + " · answer " +
      (ep.answer === null ? "(none)" : JSON.stringify(ep.answer)) + (ep.error ? " · policy error: " + ep.error : "")));
    card.appendChild(el("div", { "class": "meta" }, "question: " + ep.task.question));
    var bar = maskBar(ep);
    if (bar) card.appendChild(bar);
    var prompt = el("details", { "class": "prompt-box" }, el("summary", null, "prompt", tokInfo(ep.prompt_tokens, "not trained")));
    prompt.appendChild(message("prompt", "prompt", ep.prompt, null));
    card.appendChild(prompt);
    ep.turns.forEach(function (t, i) {
      card.appendChild(message("policy" + (t.kind === "invalid" ? " invalid" : ""), "policy · turn " + (i + 1) + " · " + t.kind,
        t.action, tokInfo(t.action_tokens, "trained")));
      if (t.error) card.appendChild(el("div", { "class": "reward" }, "invalid: " + t.error));
      t.calls.forEach(function (c, j) {
        var res = t.results[j];
        var d = el("details", { "class": "tool" + (res && res.status !== "ok" ? " err" : "") },
          el("summary", null, "tool call " + c.name + (res ? " → " + res.status + " in " + fmt(res.latency_s) + " s" +
            (res.attempts > 1 ? ", " + res.attempts + " attempts" : "") + (res.truncated ? ", truncated" : "") : "")));
        d.appendChild(el("div", null, "arguments:"));
        d.appendChild(el("pre", null, c.arguments));
        if (res) { d.appendChild(el("div", null, "result:")); d.appendChild(el("pre", null, res.content)); }
        card.appendChild(d);
      });
      if (t.observation) card.appendChild(message("obs", "observation · turn " + (i + 1), t.observation,
        tokInfo(t.observation_tokens, "not trained")));
      card.appendChild(el("div", { "class": "reward" }, "turn " + (i + 1) + " reward " + fmt(t.reward)));
    });
    card.appendChild(el("div", { "class": "reward" }, "final reward " + fmt(ep.reward)));
    var info = ep.score_info || {};
    var keys = Object.keys(info);
    if (keys.length) {  // the verifiers' components; a group judge's tokens in/out, seconds, calls, fallback, audit
      var sc = el("details", { "class": "tool" }, el("summary", null, "score details (" + keys.length + ")"));
      sc.appendChild(el("pre", null, keys.map(function (k) { return k + ": " + fmt(info[k]); }).join("\n")));
      card.appendChild(sc);
    }
    return card;
  }
  function renderDetail(ep) {
    var d = clear(document.getElementById("detail"));
    if (!ep) { d.appendChild(el("div", { "class": "empty" }, "pick an episode")); return; }
    d.appendChild(episodeCard(ep));
  }

  // ---------------------------------------------------------------- the same task at two steps
  function renderCompare(ep, st) {
    var box = clear(document.getElementById("compare"));
    if (!ep) return;
    var same = EPISODES.filter(function (e) { return e.task.id === ep.task.id; });
    var steps = uniq(same.map(function (e) { return e.step; })).sort(numSort);
    if (steps.length < 2) {
      box.appendChild(el("div", { "class": "empty" }, "this task was stored at one step only (no side-by-side)"));
      return;
    }
    var a = steps.indexOf(Number(st.a)) >= 0 ? Number(st.a) : steps[0];
    var b = steps.indexOf(Number(st.b)) >= 0 ? Number(st.b) : steps[steps.length - 1];
    function pick(step) {
      var at = same.filter(function (e) { return e.step === step; });
      return at.filter(function (e) { return e.source === ep.source; })[0] || at[0];
    }
    var opts = steps.map(function (s) { return [s, "step " + s]; });
    box.appendChild(el("h2", null, "same task at two steps: ",
      select("cmp-a", opts, a, function (v) { setState({ a: v }); }), " vs ",
      select("cmp-b", opts, b, function (v) { setState({ b: v }); })));
    var cols = el("div", { "class": "cols", id: "compare-cols" });
    cols.appendChild(episodeCard(pick(a), "step " + a + " · " + pick(a).source));
    cols.appendChild(episodeCard(pick(b), "step " + b + " · " + pick(b).source));
    box.appendChild(cols);
  }

  // ---------------------------------------------------------------- page
  function render() {
    var st = readState();
    var r = resolve(st);
    renderControls(r);
    var eps = visible(r);
    var ep = null;
    if (st.ep) ep = EPISODES.filter(function (e) { return e.key === st.ep; })[0] || null;
    if (!ep) ep = eps[0] || null;
    renderList(r, eps, ep ? ep.key : null);
    renderDetail(ep);
    renderCompare(ep, st);
    document.body.setAttribute("data-visible", String(eps.length));
    document.body.setAttribute("data-ready", "1");
  }
  document.getElementById("run-name").textContent = "rlf viewer · " + DATA.run;
  document.getElementById("run-info").textContent = count(EPISODES.length, "stored episode") + " at " + count(allSteps().length, "step");
  if (DATA.problems && DATA.problems.length) {
    var p = el("div", { "class": "problems" }, "could not read: " + DATA.problems.join("; "));
    document.body.insertBefore(p, document.querySelector("main"));
  }
  renderCurves();
  window.addEventListener("hashchange", render);
  render();
})();
