// Building elements. Text is only ever set as text (textContent), never parsed as
// HTML: whatever the model writes, or a request id holds, shows as the characters
// it is.

export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (value === undefined || value === null) continue;
    if (name === "text") node.textContent = value;
    else if (name === "className") node.className = value;
    else if (name === "dataset") Object.assign(node.dataset, value);
    else if (name === "style") Object.assign(node.style, value);
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    if (child !== null && child !== undefined) {
      node.append(typeof child === "string" ? document.createTextNode(child) : child);
    }
  }
  return node;
}

export const $ = (selector) => document.querySelector(selector);

// Writes text only when it differs: an unchanged write still costs the browser a
// layout, several times a second on the engine view.
export function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

// Makes `nodes` the children of `parent`, touching the DOM only if they differ.
export function sameChildren(parent, nodes) {
  const now = parent.children;
  if (now.length === nodes.length && nodes.every((node, i) => now[i] === node)) return;
  parent.replaceChildren(...nodes);
}

export function formatSeconds(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  return seconds < 1 ? `${(seconds * 1000).toFixed(0)} ms` : `${seconds.toFixed(2)} s`;
}

export function formatPercent(fraction) {
  return fraction === null || fraction === undefined ? "–" : `${(fraction * 100).toFixed(1)}%`;
}
