// The live dashboard: polls /cluster/stats and /cluster/decisions each second and draws
// each replica's queue, KV blocks and hit rate, the reuse ledger and the recent routing
// decisions. Vanilla JS and uPlot, no build step. A failed fetch is shown in the status
// line and never thrown: the page keeps polling through a restart of the cluster.
"use strict";
(function () {
  const POLL_MS = 1000;
  const MAX_POINTS = 300;
  const DECISIONS_LIMIT = 50;
  const MISSING_RETRY_POLLS = 10; // /cluster/decisions absent: ask again every 10 polls
  const COLORS = ["#3b6fd4", "#d4533b", "#2f9e6e", "#9a5bd1", "#c7901c", "#5b8a9a"];
  const REPLICA_FIELDS = [
    "num_waiting", "num_running", "blocks_in_use", "blocks_cached", "blocks_free",
    "hit_rate", "prompt_tokens", "cached_prompt_tokens", "in_flight", "pulls",
    "store_blocks", "store_restored_blocks",
  ];
  // each replica's charts: [name, title, [[field, label], ...], fixed y range or null]
  const REPLICA_CHARTS = [
    ["queue", "Queue", [["num_waiting", "waiting"], ["num_running", "running"]], null],
    ["blocks", "KV blocks", [["blocks_in_use", "in use"], ["blocks_cached", "cached"],
      ["blocks_free", "free"]], null],
    ["hit_rate", "Hit rate", [["hit_rate", "cached / prompt tokens"]], [0, 1]],
  ];
  const STORE_CHART = ["store", "Node store", [["store_blocks", "blocks"],
    ["store_restored_blocks", "restored"]], null];

  const series = {
    time: [],
    replicas: {},
    ledger: { delivered_per_reusable: [], routed_per_reusable: [] },
  };
  const state = {
    polls: 0, replicas: 0, series: series, lastStats: null, lastDecisions: null,
    errors: 0, charts: [],
  };
  window.dashboard = state;
  let previousTotals = null;
  let decisionsMissingFor = 0;

  async function getJSON(url) {
    // {ok, status, body}; never throws (a network error is status 0)
    try {
      const response = await fetch(url, { credentials: "same-origin", cache: "no-store" });
      if (!response.ok) return { ok: false, status: response.status, body: null };
      return { ok: true, status: response.status, body: await response.json() };
    } catch (error) {
      return { ok: false, status: 0, body: null };
    }
  }

  function element(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function makeChart(parent, key, title, lines, range) {
    // a uPlot chart over series.time and the arrays lines' getter returns
    const box = element("div", { class: "chart", "data-chart": key });
    parent.appendChild(box);
    const scale = range ? { range: range } : { range: (u, min, max) => [0, Math.max(1, max)] };
    const plot = new uPlot({
      title: title,
      width: Math.max(280, box.clientWidth),
      height: 150,
      scales: { x: { time: true }, y: scale },
      series: [{}].concat(lines.map((line, i) => ({
        label: line.label, stroke: COLORS[i % COLORS.length], width: 1.5,
      }))),
      axes: [{}, { size: 50 }],
      legend: { live: false },
    }, [series.time].concat(lines.map((line) => line.values())), box);
    state.charts.push({ key: key, box: box, plot: plot, lines: lines });
  }

  function addReplica(id) {
    const values = {};
    for (const field of REPLICA_FIELDS) values[field] = series.time.map(() => null);
    series.replicas[id] = values;
    const card = element("div", { class: "replica", "data-replica": id });
    card.appendChild(element("h3", {}, id));
    card.appendChild(element("dl", { class: "summary" }));
    card.appendChild(element("div", { class: "charts" }));
    document.getElementById("replicas").appendChild(card);
    for (const chart of REPLICA_CHARTS) addReplicaChart(id, card, chart);
  }

  function addReplicaChart(id, card, [name, title, fields, range]) {
    const values = series.replicas[id];
    const lines = fields.map(([field, label]) => ({ label: label, values: () => values[field] }));
    makeChart(card.querySelector(".charts"), `replica:${id}:${name}`, title, lines, range);
  }

  function push(array, value) {
    array.push(value === undefined ? null : value);
  }

  function trim() {
    const extra = series.time.length - MAX_POINTS;
    if (extra <= 0) return;
    const arrays = [series.time, ...Object.values(series.ledger)];
    for (const values of Object.values(series.replicas)) arrays.push(...Object.values(values));
    for (const array of arrays) array.splice(0, extra);
  }

  function ratio(part, whole) {
    // null where nothing was reusable, or where totals went back (another ingress replica)
    return whole > 0 && part >= 0 ? part / whole : null;
  }

  function record(stats, decisions) {
    // one point in every series: each replica's numbers, the ledger's deltas
    const replicas = stats.replicas || {};
    for (const id of Object.keys(replicas).sort()) {
      if (!(id in series.replicas)) addReplica(id);
    }
    series.time.push(Date.now() / 1000);
    for (const [id, values] of Object.entries(series.replicas)) {
      const now = replicas[id] || {};
      for (const field of REPLICA_FIELDS) push(values[field], now[field]);
    }
    const totals = decisions && decisions.totals ? decisions.totals : null;
    let delivered = null;
    let routed = null;
    if (totals && previousTotals) {
      const reusable = totals.reusable - previousTotals.reusable;
      delivered = ratio(totals.delivered - previousTotals.delivered, reusable);
      routed = ratio(totals.routed - previousTotals.routed, reusable);
    }
    if (totals) previousTotals = totals;
    series.ledger.delivered_per_reusable.push(delivered);
    series.ledger.routed_per_reusable.push(routed);
    trim();
  }

  function storeCharts(stats) {
    // a replica's node-store chart, once it reports the store's numbers
    for (const [id, now] of Object.entries(stats.replicas || {})) {
      const key = `replica:${id}:store`;
      if (now.store_blocks === undefined || state.charts.some((c) => c.key === key)) continue;
      const card = document.querySelector(`.replica[data-replica="${CSS.escape(id)}"]`);
      if (card) addReplicaChart(id, card, STORE_CHART);
    }
  }

  function fill(list, entries) {
    list.replaceChildren();
    for (const [name, value] of entries) {
      const item = element("div");
      item.appendChild(element("dt", {}, name));
      item.appendChild(element("dd", {}, value === undefined || value === null ? "-" : value));
      list.appendChild(item);
    }
  }

  function milliseconds(seconds) {
    return typeof seconds === "number" ? `${(seconds * 1000).toFixed(2)} ms` : null;
  }

  function showSummary(stats, decisions) {
    const routed = Object.entries(stats.routed || {}).map(([id, n]) => `${id}: ${n}`);
    const totals = (decisions && decisions.totals) || {};
    fill(document.getElementById("summary"), [
      ["policy", stats.policy], ["replicas", state.replicas],
      ["routed", routed.join(", ") || null],
      ["decision p50", milliseconds(stats.decision_p50_s)],
      ["decision p99", milliseconds(stats.decision_p99_s)],
      ["requests", totals.requests], ["prompt tokens", totals.prompt_tokens],
      ["reusable tokens", totals.reusable], ["routed to a holder", totals.routed],
      ["delivered", totals.delivered],
    ]);
    for (const card of document.querySelectorAll(".replica")) {
      const now = (stats.replicas || {})[card.dataset.replica];
      card.classList.toggle("gone", !now);
      const hit = now && typeof now.hit_rate === "number" ? now.hit_rate.toFixed(3) : null;
      fill(card.querySelector("dl"), !now ? [["state", "gone"]] : [
        ["in flight", now.in_flight], ["prompt tokens", now.prompt_tokens],
        ["cached", now.cached_prompt_tokens], ["hit rate", hit], ["pulls", now.pulls],
        ["pulled blocks", now.pulled_blocks],
        ["streams moved out", now.moves], ["moves failed", now.moves_failed],
        ["moved MB", typeof now.moved_bytes === "number" ?
          (now.moved_bytes / 2 ** 20).toFixed(1) : null],
        ["pushes taken", now.moves_received],
      ]);
    }
  }

  function showDecisions(decisions) {
    const rows = (decisions && decisions.decisions) || [];
    const note = document.getElementById("decisions-note");
    note.textContent = decisions ? `${rows.length} most recent, newest first` :
      "no decisions yet";
    const body = document.querySelector("#decisions tbody");
    body.replaceChildren();
    for (const d of rows.slice().reverse()) {
      const row = element("tr");
      const when = new Date(d.time * 1000).toLocaleTimeString();
      const cells = [when, String(d.request_id).slice(0, 12), d.tenant, d.replica, d.reason,
        d.prompt_tokens, d.reusable, d.routed, d.delivered, d.restored, d.pulled];
      cells.forEach((value, i) => {
        const cell = element("td", i === 4 ? { class: "reason" } : {}, value ?? "");
        if (i === 1) cell.title = d.request_id;
        row.appendChild(cell);
      });
      body.appendChild(row);
    }
  }

  function redraw() {
    for (const chart of state.charts) {
      chart.plot.setData([series.time].concat(chart.lines.map((line) => line.values())));
    }
  }

  function resize() {
    for (const chart of state.charts) {
      chart.plot.setSize({ width: Math.max(280, chart.box.clientWidth), height: 150 });
    }
  }

  async function fetchDecisions() {
    // null while the endpoint is absent (404) or failing; asked less often once absent
    if (decisionsMissingFor > 0 && decisionsMissingFor++ % MISSING_RETRY_POLLS !== 0) {
      return null;
    }
    const got = await getJSON(`/cluster/decisions?limit=${DECISIONS_LIMIT}`);
    decisionsMissingFor = got.status === 404 ? Math.max(1, decisionsMissingFor) : 0;
    return got.ok ? got.body : null;
  }

  async function poll() {
    const [stats, decisions] = await Promise.all([getJSON("/cluster/stats"), fetchDecisions()]);
    const status = document.getElementById("status");
    if (!stats.ok) {
      state.errors += 1;
      status.textContent = `/cluster/stats: ${stats.status ? "HTTP " + stats.status : "unreachable"}`;
      status.classList.add("bad");
      return;
    }
    state.polls += 1;
    state.lastStats = stats.body;
    state.lastDecisions = decisions;
    state.replicas = Object.keys(stats.body.replicas || {}).length;
    record(stats.body, decisions);
    storeCharts(stats.body);
    showSummary(stats.body, decisions);
    showDecisions(decisions);
    redraw();
    status.textContent = `live: ${state.polls} polls, ${new Date().toLocaleTimeString()}`;
    status.classList.remove("bad");
  }

  async function loop() {
    try {
      await poll();
    } finally {
      setTimeout(loop, POLL_MS);
    }
  }

  makeChart(document.getElementById("ledger"), "ledger", "Reuse ledger", [
    { label: "delivered / reusable", values: () => series.ledger.delivered_per_reusable },
    { label: "routed / reusable", values: () => series.ledger.routed_per_reusable },
  ], null);
  window.addEventListener("resize", resize);
  loop();
})();
