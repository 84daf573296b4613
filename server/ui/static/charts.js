// Drawing: the KV cache's block map on a canvas, and sparklines in SVG.

export const BLOCK_STATES = [
  // The order of the server's state digits ("0" .. "4").
  { name: "free", label: "free", color: "#e3e6ea" },
  { name: "cached", label: "cached, evictable", color: "#9cc9e6" },
  { name: "used", label: "in use", color: "#2f6fb0" },
  { name: "shared", label: "shared prefix", color: "#e8731a" },
  { name: "copy_on_write", label: "shared, copy-on-write", color: "#b3151f" },
];

// The block map on a canvas, painted incrementally: a snapshot repaints only the
// cells whose state or outline changed, and an idle engine's map costs nothing to
// show (the page must not slow the engine it watches when both share a machine).
export class BlockMap {
  constructor(canvas) {
    this.canvas = canvas;
    this.layout = ""; // what the canvas was sized for: width, cell count, pixel ratio
    this.cells = ""; // the states painted, one digit per cell
    this.outlined = new Set(); // the cells painted with an outline
  }

  // cells: one state digit per cell; highlight: a Set of cell indexes to outline.
  draw(cells, highlight = new Set()) {
    const width = this.canvas.clientWidth || 400;
    const count = Math.max(cells.length, 1);
    const ratio = window.devicePixelRatio || 1;
    const layout = `${width} ${count} ${ratio}`;
    if (layout !== this.layout) this.resize(layout, width, count, ratio);
    const ctx = this.canvas.getContext("2d");
    for (let i = 0; i < cells.length; i++) {
      const outline = highlight.has(i);
      if (cells[i] !== this.cells[i] || outline !== this.outlined.has(i)) this.paint(ctx, i, cells[i], outline);
    }
    this.cells = cells;
    this.outlined = new Set(highlight);
  }

  // Square cells as large as fit in about 220 px of height, between 3 and 14 px.
  resize(layout, width, count, ratio) {
    this.layout = layout;
    this.size = Math.max(3, Math.min(14, Math.floor(Math.sqrt((width * 220) / count))));
    this.perRow = Math.max(1, Math.floor(width / this.size));
    this.gap = this.size > 5 ? 1 : 0;
    const height = Math.ceil(count / this.perRow) * this.size;
    this.canvas.width = Math.round(width * ratio); // clears it: every cell is repainted
    this.canvas.height = Math.round(height * ratio);
    this.canvas.style.height = `${height}px`;
    this.canvas.getContext("2d").setTransform(ratio, 0, 0, ratio, 0, 0);
    this.cells = "";
    this.outlined = new Set();
  }

  paint(ctx, i, digit, outline) {
    const { size, gap } = this;
    const x = (i % this.perRow) * size;
    const y = Math.floor(i / this.perRow) * size;
    const state = BLOCK_STATES[digit.charCodeAt(0) - 48] || BLOCK_STATES[0];
    ctx.clearRect(x, y, size, size);
    ctx.fillStyle = state.color;
    ctx.fillRect(x, y, size - gap, size - gap);
    if (outline) { // drawn inside the cell, so repainting one cell never leaves a trace
      const line = Math.max(1, size / 5);
      ctx.strokeStyle = "#111";
      ctx.lineWidth = line;
      ctx.strokeRect(x + line / 2, y + line / 2, size - gap - line, size - gap - line);
    }
  }
}

const NS = "http://www.w3.org/2000/svg";

// xs: each point's place along the line (0 .. 1, time over the window shown);
// series: [{values: [number|null], color}], drawn over shared axes from 0 to the
// largest value. A null is a gap; a point alone between gaps shows as a dot.
export function drawSparkline(svg, xs, series, width = 240, height = 36) {
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.replaceChildren();
  const top = Math.max(...series.flatMap((s) => s.values.filter((v) => v !== null)), 0) || 1;
  for (const { values, color } of series) {
    let path = "";
    let pen = "M";
    values.forEach((value, i) => {
      if (value === null || value === undefined) {
        pen = "M";
        return;
      }
      const x = xs[i] * width;
      const y = height - 2 - (value / top) * (height - 4);
      path += `${pen}${x.toFixed(1)},${y.toFixed(1)} ${pen === "M" ? "l0.01,0 " : ""}`;
      pen = "L";
    });
    const line = document.createElementNS(NS, "path");
    line.setAttribute("d", path.trim() || "M0,0");
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", color);
    line.setAttribute("stroke-width", "2");
    line.setAttribute("stroke-linecap", "round");
    line.setAttribute("stroke-linejoin", "round");
    line.setAttribute("vector-effect", "non-scaling-stroke");
    svg.append(line);
  }
}
