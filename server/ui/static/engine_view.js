// The engine view: one stream from GET /v1/engine/stream, open only while the page
// is visible (a hidden tab costs the engine nothing), reconnecting after a failure.

import { ApiError, readEventStream } from "./api.js";
import { BLOCK_STATES, BlockMap, drawSparkline } from "./charts.js";
import { $, el, formatPercent, formatSeconds, sameChildren, setText } from "./dom.js";
import { finishedText, requestProgress } from "./format.js";

const SHOWN_FINISHED = 12;
const RETRY_MS = 2000;

const SPARKLINES = [
  { id: "ttft", title: "time to first token (mean)", series: [["ttft", "#2f6fb0"]], format: formatSeconds },
  { id: "itl", title: "inter-token latency (mean)", series: [["itl", "#2f6fb0"]], format: formatSeconds },
  { id: "tokens", title: "generated tokens/s", series: [["tokens_per_s", "#2a9d5c"]],
    format: (v) => (v === null ? "–" : v.toFixed(1)) },
  { id: "per-step", title: "tokens per step: prefill · decode",
    series: [["prefill_per_step", "#e8731a"], ["decode_per_step", "#2f6fb0"]],
    format: (v) => (v === null ? "–" : v.toFixed(1)) },
  { id: "hits", title: "prefix hit rate", series: [["hit_rate", "#8e44ad"]], format: formatPercent },
  { id: "acceptance", title: "draft acceptance", series: [["acceptance", "#b3151f"]],
    format: formatPercent, speculative: true },
];

function rate(points, part, whole) {
  let num = 0;
  let den = 0;
  for (const p of points) {
    num += p[part] || 0;
    den += p[whole] || 0;
  }
  return den ? num / den : null;
}

function withRates(point) {
  const hit = point.prefix_queries ? point.prefix_hits / point.prefix_queries : null;
  const acc = point.draft_tokens ? point.accepted_tokens / point.draft_tokens : null;
  return { ...point, hit_rate: hit, acceptance: acc };
}

function lastValue(points, key) {
  for (let i = points.length - 1; i >= 0; i--) if (points[i][key] !== null) return points[i][key];
  return null;
}

// Another key's request comes without its id (shown to admin keys only).
const HIDDEN_ID = "another key's request";

function label(r) {
  const id = r.id || "·";
  return r.index ? `${id} #${r.index}` : id;
}

// A sequence's row in the request table; its blocks are outlined on the map while
// the pointer is over it.
class RequestRow {
  constructor(key, r, view) {
    this.phase = el("span");
    this.bar = el("span", { className: "bar" });
    this.counts = el("span");
    this.prompt = el("span", { className: "muted" });
    this.cached = el("td");
    this.blocks = el("td");
    this.tr = el("tr", { dataset: { id: r.id || "" } },
      el("td", { className: "id", text: label(r), title: r.id || HIDDEN_ID }),
      el("td", {}, this.phase),
      el("td", {}, el("span", { className: "progress" }, this.bar), this.counts, this.prompt),
      this.cached, this.blocks);
    this.tr.addEventListener("mouseenter", () => { view.hovered = key; view.drawMap(); });
    this.tr.addEventListener("mouseleave", () => { view.hovered = null; view.drawMap(); });
  }

  update(r, mine) {
    const data = this.tr.dataset;
    if (data.phase !== r.phase) {
      data.phase = r.phase;
      this.phase.className = `phase ${r.phase}`;
      this.phase.textContent = r.phase;
    }
    if (data.mine !== String(mine)) data.mine = String(mine);
    const progress = requestProgress(r);
    const done = `${Math.round(100 * progress.fraction)}%`;
    if (this.bar.style.width !== done) this.bar.style.width = done;
    setText(this.counts, ` ${progress.text}`);
    setText(this.prompt, ` (prompt ${r.prompt_tokens})`);
    setText(this.cached, String(r.cached_tokens));
    setText(this.blocks, String(r.blocks.reduce((sum, [, count]) => sum + count, 0)));
  }
}

export class EngineView {
  constructor() {
    this.points = [];
    this.maxPoints = 300; // the hello event tells the real window
    this.pointSeconds = 1;
    this.snapshotSeconds = 0.5; // the hello event tells the real interval
    this.pointsDrawn = true; // every point received is on the sparklines
    this.pointTimer = null; // draws points that no snapshot came to draw
    this.snapshot = null;
    this.speculative = false;
    this.mine = new Set(); // engine ids of this page's requests
    this.hovered = null; // the request row under the pointer: its blocks are outlined
    this.controller = null;
    this.endedBecause = null; // why the server ended the stream, when it said
    this.blockMap = new BlockMap($("#block-map"));
    this.rows = new Map(); // sequence -> its RequestRow in the table
    this.idleRow = el("tr", {}, el("td", { colspan: "5", className: "muted", text: "idle: no requests" }));
    this.finishedKey = null; // what the "just finished" list shows
    this.finishedItems = [];
    this.buildLegend();
    this.buildSparklines();
    document.addEventListener("visibilitychange", () => this.followVisibility());
    window.addEventListener("resize", () => this.drawMap());
  }

  markMine(engineId) {
    this.mine.add(engineId);
  }

  isMine(engineId) {
    // The server runs prompt i of engine request R as "R-i".
    if (!engineId) return false;
    for (const id of this.mine) if (engineId === id || engineId.startsWith(`${id}-`)) return true;
    return false;
  }

  start() {
    this.followVisibility();
  }

  restart() {
    if (this.controller) this.controller.abort();
    this.controller = null;
    this.followVisibility();
  }

  followVisibility() {
    if (document.visibilityState === "hidden") {
      if (this.controller) this.controller.abort();
      this.controller = null;
      this.setStatus("paused while the page is hidden");
    } else if (!this.controller) {
      this.connect();
    }
  }

  async connect() {
    const controller = new AbortController();
    this.controller = controller;
    this.setStatus("connecting to the engine…");
    this.endedBecause = null;
    try {
      await readEventStream("/v1/engine/stream", (event, data) => this.onEvent(event, data),
        controller.signal);
      if (this.controller === controller) {
        this.setStatus(this.endedBecause || "the engine stream ended", "error");
      }
    } catch (error) {
      if (controller.signal.aborted) return;
      const needKey = error instanceof ApiError && error.status === 401;
      this.setStatus(needKey ? `the engine view needs the API key: ${error.message}`
        : `engine stream: ${error.message}`, "error");
      if (needKey) {
        this.controller = null; // retried when a key is typed
        return;
      }
    }
    if (this.controller !== controller) return;
    setTimeout(() => {
      if (this.controller === controller) {
        this.controller = null;
        this.followVisibility();
      }
    }, RETRY_MS);
  }

  setStatus(text, kind = "") {
    const status = $("#engine-status");
    status.textContent = text;
    status.dataset.kind = kind;
  }

  onEvent(event, data) {
    if (event === "hello") {
      this.points = data.history.map(withRates);
      this.pointSeconds = data.point_seconds;
      this.maxPoints = data.window_points;
      this.snapshotSeconds = data.snapshot_seconds;
      this.setStatus(`live: a snapshot every ${data.snapshot_seconds} s`, "live");
      this.drawSparklines();
    } else if (event === "point") {
      this.points.push(withRates(data));
      if (this.points.length > this.maxPoints) this.points.shift();
      // Drawn with the next snapshot, in the same frame (each frame the browser
      // paints costs the machine it runs on); alone if no snapshot comes soon.
      this.pointsDrawn = false;
      if (this.pointTimer === null) {
        this.pointTimer = setTimeout(() => this.drawPoints(), this.snapshotSeconds * 1000 + 100);
      }
    } else if (event === "snapshot") {
      this.snapshot = data;
      this.speculative = data.speculative;
      this.render();
      this.drawPoints();
    } else if (event === "engine_dead") { // the stream ends after these two
      this.endedBecause = `engine: ${data.error}`;
    } else if (event === "closing") {
      this.endedBecause = `server: ${data.reason}`;
    }
  }

  // -- one snapshot ---------------------------------------------------------
  // Every part is written only where it changed: the engine view runs a few times a
  // second, and an idle engine's view should cost the browser (and a machine it may
  // share with the server) nothing.
  render() {
    const s = this.snapshot;
    setText($("#card-running"), String(s.num_running));
    setText($("#card-waiting"), String(s.num_waiting));
    const counts = s.block_counts;
    const held = counts.used + counts.shared + counts.copy_on_write;
    setText($("#card-kv"), formatPercent(held / s.num_blocks));
    this.renderRates();
    const cell = s.blocks_per_cell > 1 ? `, ${s.blocks_per_cell} blocks a cell` : "";
    setText($("#block-summary"), `${s.num_blocks} blocks of ${s.block_size} tokens${cell}`);
    for (const state of BLOCK_STATES) {
      setText($(`#block-legend [data-state="${state.name}"] .count`), String(counts[state.name]));
    }
    this.drawMap();
    this.renderRequests();
    this.renderFinished();
  }

  drawPoints() {
    clearTimeout(this.pointTimer);
    this.pointTimer = null;
    if (this.pointsDrawn) return;
    this.pointsDrawn = true;
    this.drawSparklines();
    this.renderRates();
  }

  // The window's pooled rates, from the points: they follow each point too, since a
  // long engine step delays snapshots but not points.
  renderRates() {
    setText($("#card-hits"), formatPercent(rate(this.points, "prefix_hits", "prefix_queries")));
    $("#card-spec-box").hidden = !this.speculative;
    setText($("#card-spec"), formatPercent(rate(this.points, "accepted_tokens", "draft_tokens")));
  }

  drawMap() {
    if (!this.snapshot) return;
    const highlight = new Set();
    const request = this.snapshot.requests.find((r) => `${r.ref}#${r.index}` === this.hovered);
    const perCell = this.snapshot.blocks_per_cell;
    for (const [first, count] of request ? request.blocks : []) {
      for (let b = first; b < first + count; b++) highlight.add(Math.floor(b / perCell));
    }
    this.blockMap.draw(this.snapshot.cells, highlight);
  }

  // One row per sequence, kept while it runs and updated in place: a decoding
  // sequence changes every snapshot, and rebuilding rows would lay out and paint
  // the whole table each time.
  renderRequests() {
    const rows = new Map();
    for (const r of this.snapshot.requests) {
      const key = `${r.ref}#${r.index}`;
      const row = this.rows.get(key) || new RequestRow(key, r, this);
      row.update(r, this.isMine(r.id));
      rows.set(key, row);
    }
    this.rows = rows;
    const nodes = [...rows.values()].map((row) => row.tr);
    if (!nodes.length) nodes.push(this.idleRow);
    sameChildren($("#requests tbody"), nodes);
  }

  // The list is rebuilt when a sequence ends; in between only its ages tick.
  renderFinished() {
    const shown = this.snapshot.finished.slice(-SHOWN_FINISHED).reverse();
    // A sequence ends once, so its ref and index name its entry (its time, worked out
    // anew for each snapshot, may move by a microsecond).
    const key = shown.map((f) => `${f.ref}#${f.index}:${this.isMine(f.id)}`).join(" ");
    if (key !== this.finishedKey) {
      this.finishedKey = key;
      this.finishedItems = shown.map((f) => {
        const age = el("span", { className: "age" });
        const text = finishedText(f);
        const item = el("li", { dataset: { id: f.id || "", reason: f.reason, mine: String(this.isMine(f.id)) } },
          el("span", { className: "id", text: label(f), title: f.id || HIDDEN_ID }),
          el("span", { className: `reason ${text.kind}`, text: text.reason }),
          el("span", { className: "muted", text: `${text.detail} · ` }), age);
        return { item, age, t: f.t };
      });
      $("#finished").replaceChildren(...this.finishedItems.map((f) => f.item));
    }
    const now = Date.now();
    for (const f of this.finishedItems) setText(f.age, `${Math.max(0, (now - f.t) / 1000).toFixed(0)} s ago`);
  }

  // -- the legend and the sparklines -------------------------------------------
  buildLegend() {
    $("#block-legend").replaceChildren(...BLOCK_STATES.map((state) => el("li", { dataset: { state: state.name } },
      el("span", { className: "swatch", style: { background: state.color } }),
      `${state.label} `, el("span", { className: "count", text: "0" }))));
  }

  buildSparklines() {
    const NS = "http://www.w3.org/2000/svg";
    $("#sparklines").replaceChildren(...SPARKLINES.map((spec) => {
      const svg = document.createElementNS(NS, "svg");
      svg.setAttribute("class", "sparkline");
      return el("div", { className: "spark", id: `spark-${spec.id}` },
        el("span", { className: "label", text: spec.title }), svg,
        el("span", { className: "value", text: "–" }));
    }));
  }

  drawSparklines() {
    // Time runs left to right over the whole window, so a fresh server's few points
    // sit at the right end instead of being stretched across.
    const span = this.maxPoints * this.pointSeconds * 1000;
    const end = this.points.length ? this.points[this.points.length - 1].t : Date.now();
    const xs = this.points.map((p) => Math.max(0, 1 - (end - p.t) / span));
    for (const spec of SPARKLINES) {
      const box = $(`#spark-${spec.id}`);
      box.hidden = Boolean(spec.speculative) && !this.speculative;
      const series = spec.series.map(([key, color]) => ({ values: this.points.map((p) => p[key]), color }));
      drawSparkline(box.querySelector("svg"), xs, series);
      setText(box.querySelector(".value"), spec.series
        .map(([key]) => spec.format(lastValue(this.points, key))).join(" · "));
    }
  }
}
