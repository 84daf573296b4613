// Talking to the server: the API key the user typed, JSON calls, and Server-Sent
// Events read from fetch() (EventSource cannot send an Authorization header).

const KEY_STORE = "kvserve.apiKey";

// The key lives as long as the tab (sessionStorage), not on disk for every later
// visitor of this browser profile and every script of the origin to read.
export function apiKey() {
  return sessionStorage.getItem(KEY_STORE) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_STORE, key);
  else sessionStorage.removeItem(KEY_STORE);
}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = apiKey();
  if (key) h["Authorization"] = `Bearer ${key}`;
  return h;
}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON: keep the status line */ }
  return new ApiError(response.status, message);
}

export async function getJSON(path, signal) {
  const response = await fetch(path, { headers: headers(false), signal });
  if (!response.ok) throw await failure(response);
  return response.json();
}

// Yields {event, data} for each event of an SSE response body.
async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.search(/\r\n\r\n|\n\n|\r\r/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^(\r\n\r\n|\n\n|\r\r)/, "");
      let event = "message";
      const data = [];
      for (const line of block.split(/\r\n|\n|\r/)) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { event, data: data.join("\n") };
    }
  }
}

// GET an event stream; calls onEvent(name, parsedData) until it ends or `signal` aborts.
export async function readEventStream(path, onEvent, signal) {
  const response = await fetch(path, { headers: headers(false), signal });
  if (!response.ok) throw await failure(response);
  for await (const { event, data } of sseEvents(response)) onEvent(event, JSON.parse(data));
}

// The header that names a request's engine id (its prompts run as "<id>-<i>").
const ENGINE_ID_HEADER = "x-kvserve-request-id";

// POST a streaming OpenAI request; calls onStart(engineId) once the server has
// answered, then onChunk(parsedChunk) for each chunk.
export async function postStream(path, body, onChunk, signal, onStart = () => {}) {
  const response = await fetch(path, {
    method: "POST", headers: headers(true), body: JSON.stringify(body), signal,
  });
  if (!response.ok) throw await failure(response);
  onStart(response.headers.get(ENGINE_ID_HEADER));
  for await (const { data } of sseEvents(response)) {
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new ApiError(500, chunk.error.message || "error");
    onChunk(chunk);
  }
}
