// gemel's live dashboard: polls /dashboard/data every second and draws it with Apache ECharts.
// The heatmap bins recent output tokens by arrival time (x, one-second columns over the last
// minute) and position within their response (y); a cell's colour is its tokens' mean latency
// since the previous token of the same response (position 0: time to first token).
(function () {
  "use strict";
  const POLL_MS = 1000;
  const WINDOW_MS = 60000;
  const MAX_ROWS = 32;
  const state = { since: null, points: [], polls: 0, heatmapCells: 0, lastError: null };
  window.gemelDashboard = state;

  const $ = (id) => document.getElementById(id);
  const charts = {};
  const base = {
    backgroundColor: "transparent",
    animation: false,
    grid: { left: 56, right: 16, top: 56, bottom: 28 },
    tooltip: { trigger: "axis" },
    legend: { top: 26, left: 8, textStyle: { color: "#c9d1d9" } },
    xAxis: { type: "time", axisLabel: { hideOverlap: true } },
  };

  function lineChart(id, title, names) {
    const chart = echarts.init($(id), "dark");
    chart.setOption(Object.assign({}, base, {
      title: { text: title, left: 8, top: 4, textStyle: { fontSize: 13 } },
      yAxis: { type: "value", min: 0 },
      series: names.map((n) => ({ name: n, type: "line", showSymbol: false, connectNulls: false, data: [] })),
    }));
    return chart;
  }

  charts.throughput = lineChart("chart-throughput", "Throughput (tokens/s)", ["generation", "prompt"]);
  charts.requests = lineChart("chart-requests", "Requests in the engine", ["running", "waiting"]);
  charts.latency = lineChart("chart-latency", "Latency percentiles over 10 s (ms)", ["TTFT p50", "TTFT p99", "ITL p50", "ITL p99"]);
  charts.cache = lineChart("chart-cache", "Caches (%)", ["KV cache used", "prefix hit rate (10 s)"]);
  charts.cache.setOption({ yAxis: { max: 100 } });

  charts.heatmap = echarts.init($("chart-heatmap"), "dark");
  charts.heatmap.setOption({
    backgroundColor: "transparent",
    animation: false,
    title: { text: "Per-token latency (x: time, y: token position in its response, colour: ms since the previous token)",
             left: 8, top: 4, textStyle: { fontSize: 13 } },
    tooltip: {
      position: "top",
      formatter: (p) => `${p.name}<br>positions ${p.data[3]}<br>mean ${p.data[2].toFixed(1)} ms over ${p.data[4]} tokens`,
    },
    grid: { left: 78, right: 90, top: 36, bottom: 40 },
    xAxis: { type: "category", data: [], name: "time", nameLocation: "middle", nameGap: 26, splitArea: { show: true } },
    yAxis: { type: "category", data: [], name: "token position", nameLocation: "middle", nameRotate: 90, nameGap: 48,
             splitArea: { show: true } },
    visualMap: {
      type: "continuous", dimension: 2, min: 0, max: 100, calculable: true, orient: "vertical", right: 8, top: "middle",
      text: ["slow", "fast"], inRange: { color: ["#1a9850", "#91cf60", "#fee08b", "#fc8d59", "#d73027"] },
      textStyle: { color: "#c9d1d9" }, formatter: (v) => `${Math.round(v)} ms`,
    },
    series: [{ name: "latency", type: "heatmap", data: [], emphasis: { itemStyle: { borderColor: "#fff", borderWidth: 1 } } }],
  });

  window.addEventListener("resize", () => Object.values(charts).forEach((c) => c.resize()));

  const fmt = (v, digits = 1) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));
  const pair = (ts, vs) => ts.map((t, i) => [t, vs[i]]);

  function drawCards(d) {
    const s = d.summary;
    $("c-gen").textContent = fmt(s.generation_tokens_per_s);
    $("c-prompt").textContent = fmt(s.prompt_tokens_per_s);
    $("c-running").textContent = s.running;
    $("c-waiting").textContent = s.waiting;
    $("c-kv").textContent = fmt(s.kv_cache_usage_perc);
    $("c-prefix").textContent = fmt(s.prefix_cache_hit_perc);
    $("c-ttft").textContent = [s.ttft_ms.p50, s.ttft_ms.p90, s.ttft_ms.p99].map((v) => fmt(v, 0)).join(" / ");
    $("c-itl").textContent = [s.itl_ms.p50, s.itl_ms.p90, s.itl_ms.p99].map((v) => fmt(v, 0)).join(" / ");
    $("c-requests").textContent = s.requests_total;
    $("models").textContent = d.models.map((m) => `${m.name} (${m.state})`).join(", ");
  }

  function drawSeries(d) {
    const s = d.series;
    charts.throughput.setOption({ series: [{ data: pair(s.t, s.gen_tps) }, { data: pair(s.t, s.prompt_tps) }] });
    charts.requests.setOption({ series: [{ data: pair(s.t, s.running) }, { data: pair(s.t, s.waiting) }] });
    charts.latency.setOption({ series: [
      { data: pair(s.t, s.ttft_p50_ms) }, { data: pair(s.t, s.ttft_p99_ms) },
      { data: pair(s.t, s.itl_p50_ms) }, { data: pair(s.t, s.itl_p99_ms) },
    ] });
    charts.cache.setOption({ series: [{ data: pair(s.t, s.kv_perc) }, { data: pair(s.t, s.prefix_hit_perc) }] });
  }

  function timeLabel(ms) {
    const t = new Date(ms);
    return t.toTimeString().slice(0, 8);
  }

  function drawHeatmap(now) {
    const start = now - WINDOW_MS;
    state.points = state.points.filter((p) => p[0] >= start);
    const cols = Math.round(WINDOW_MS / 1000);
    let maxPos = 0;
    for (const p of state.points) maxPos = Math.max(maxPos, p[1]);
    const bin = Math.max(1, Math.ceil((maxPos + 1) / MAX_ROWS));
    const rows = Math.max(1, Math.ceil((maxPos + 1) / bin));
    const sums = new Map();
    for (const [t, pos, lat] of state.points) {
      const x = Math.min(cols - 1, Math.max(0, Math.floor((t - start) / 1000)));
      const y = Math.floor(pos / bin);
      const key = x * 100000 + y;
      const cell = sums.get(key) || [x, y, 0, 0];
      cell[2] += lat;
      cell[3] += 1;
      sums.set(key, cell);
    }
    const yLabels = [];
    for (let r = 0; r < rows; r++) yLabels.push(bin === 1 ? String(r) : `${r * bin}–${r * bin + bin - 1}`);
    const xLabels = [];
    for (let c = 0; c < cols; c++) xLabels.push(timeLabel(start + c * 1000));
    const data = [];
    const values = [];
    for (const [x, y, sum, n] of sums.values()) {
      const mean = sum / n;
      values.push(mean);
      data.push([x, y, mean, yLabels[y], n]);
    }
    values.sort((a, b) => a - b);
    const hi = values.length ? values[Math.min(values.length - 1, Math.floor(values.length * 0.95))] : 100;
    charts.heatmap.setOption({
      xAxis: { data: xLabels },
      yAxis: { data: yLabels },
      visualMap: { max: Math.max(1, Math.ceil(hi)) },
      series: [{ data: data }],
    });
    state.heatmapCells = data.length;
  }

  // One row per route target: its weight and share now, requests it served, its canary window.
  function drawRoutes(d) {
    const routes = d.routes || [];
    $("routes-panel").hidden = routes.length === 0;
    const body = $("routes-table").tBodies[0];
    body.replaceChildren();
    const notes = [];
    for (const r of routes) {
      r.targets.forEach((t, i) => {
        const w = t.slo_window;
        const cells = [
          i === 0 ? r.name : "", t.model + (t.canary ? " (canary)" : ""), t.engine || "", fmt(t.weight, 0),
          fmt(100 * t.share, 1) + " %", t.requests, t.status + (t.reason ? `: ${t.reason}` : ""),
          w ? `${w.seen}/${w.size}: ${fmt(w.ttft_p99_ms, 0)} ms / ${fmt(w.error_rate === null ? null : 100 * w.error_rate, 1)} %` : "–",
          t.rollbacks,
        ];
        const row = body.insertRow();
        if (t.status === "rolled_back") row.className = "rolled-back";
        for (const c of cells) row.insertCell().textContent = String(c);
      });
      const fb = Object.entries(r.fallbacks || {}).map(([k, n]) => `${k} ${n}`).join(", ");
      if (r.fallback) notes.push(`${r.name}: fallback ${r.fallback}` + (fb ? ` (served: ${fb})` : " (not used)"));
    }
    $("routes-fallbacks").textContent = notes.join(" · ");
  }

  async function poll() {
    try {
      const url = state.since === null ? "/dashboard/data" : `/dashboard/data?since=${state.since}`;
      const resp = await fetch(url, { cache: "no-store" });
      if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
      const d = await resp.json();
      if (state.since !== null && d.tokens.next < state.since) state.points = []; // the server restarted
      state.since = d.tokens.next;
      for (const p of d.tokens.points) state.points.push(p);
      drawCards(d);
      drawSeries(d);
      drawHeatmap(d.now);
      drawRoutes(d);
      state.polls += 1;
      state.lastError = null;
      $("status").textContent = `updated ${timeLabel(d.now)}`;
    } catch (e) {
      state.lastError = String(e);
      $("status").textContent = `cannot reach gemel (${e.message || e}); retrying`;
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  poll();
})();
