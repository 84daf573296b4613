// The playground: a streaming chat and a raw completions tab over the public
// OpenAI endpoints. Stop aborts the fetch; the server sees the client go and aborts
// the request in the engine (the engine view then lists it as aborted).

import { ApiError, postStream } from "./api.js";
import { $, el } from "./dom.js";
import { answerStats } from "./format.js";

// One streamed answer: when its chunks came, and the token counts they carried.
class AnswerClock {
  constructor() {
    this.sent = performance.now();
    this.first = null;
    this.last = null;
    this.usage = null; // the latest the stream reported
  }

  chunk() {
    this.last = performance.now();
    if (this.first === null) this.first = this.last;
  }

  summary(note) {
    return answerStats({ usage: this.usage, sent: this.sent, first: this.first, last: this.last, note });
  }
}

function number(id) {
  const value = $(`#${id}`).value.trim();
  return value === "" ? undefined : Number(value);
}

// The sampling fields and the JSON typed under "More request fields".
function samplingBody() {
  const body = {
    temperature: number("temperature"), top_p: number("top_p"), max_tokens: number("max_tokens"),
    seed: number("seed"),
  };
  const topK = number("top_k");
  if (topK !== undefined && topK !== -1) body.top_k = topK;
  const stops = $("#stop-strings").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stops.length) body.stop = stops;
  const extra = $("#extra-body").value.trim();
  if (extra) Object.assign(body, JSON.parse(extra)); // a SyntaxError is shown to the user
  for (const key of Object.keys(body)) if (body[key] === undefined) delete body[key];
  return body;
}

export class Playground {
  constructor({ model, onRequest }) {
    this.model = model; // () => the selected model's name
    this.onRequest = onRequest; // called with each answer's engine request id
    this.history = []; // the chat's messages, system prompt excluded
    this.running = null; // the AbortController of the answer being streamed
    this.bindTabs();
    this.bindChat();
    this.bindCompletions();
  }

  bindTabs() {
    for (const tab of document.querySelectorAll("[data-tab]")) {
      tab.addEventListener("click", () => {
        for (const other of document.querySelectorAll("[data-tab]")) {
          const selected = other === tab;
          other.setAttribute("aria-selected", String(selected));
          $(`#${other.dataset.tab}-tab`).hidden = !selected;
        }
      });
    }
  }

  bindChat() {
    $("#chat-form").addEventListener("submit", (event) => {
      event.preventDefault();
      this.sendChat();
    });
    $("#chat-input").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.sendChat();
      }
    });
    $("#stop").addEventListener("click", () => this.stop());
    $("#new-chat").addEventListener("click", () => {
      this.stop();
      this.history = [];
      $("#messages").replaceChildren();
      $("#answer-stats").textContent = "";
    });
  }

  bindCompletions() {
    $("#complete").addEventListener("click", () => this.complete());
    $("#complete-stop").addEventListener("click", () => this.stop());
  }

  stop() {
    if (this.running) this.running.abort();
  }

  setBusy(busy) {
    $("#send").disabled = busy;
    $("#complete").disabled = busy;
    $("#stop").disabled = !busy;
    $("#complete-stop").disabled = !busy;
  }

  addMessage(role, text) {
    const body = el("div", { className: "content", text });
    const message = el("div", { className: `message ${role}`, dataset: { role } },
      el("div", { className: "role", text: role }), body);
    $("#messages").append(message);
    message.scrollIntoView({ block: "end" });
    return message;
  }

  async sendChat() {
    const text = $("#chat-input").value;
    if (this.running || !text.trim()) return;
    $("#chat-input").value = "";
    this.history.push({ role: "user", content: text });
    this.addMessage("user", text);
    const answer = this.addMessage("assistant", "");
    const content = answer.querySelector(".content");
    let thinking = null;
    const system = $("#system-prompt").value.trim();
    const messages = system ? [{ role: "system", content: system }, ...this.history] : this.history;
    let reply = "";
    const outcome = await this.stream("/v1/chat/completions", { messages }, (choice) => {
      const delta = choice.delta || {};
      const reasoning = delta.reasoning_content || delta.reasoning;
      if (reasoning) {
        if (!thinking) {
          thinking = el("div", { className: "thinking" });
          answer.insertBefore(thinking, content);
        }
        thinking.textContent += reasoning;
      }
      if (delta.content) {
        reply += delta.content;
        content.textContent = reply;
        answer.scrollIntoView({ block: "end" });
      }
    }, answer);
    if (reply) this.history.push({ role: "assistant", content: reply });
    answer.dataset.outcome = outcome;
  }

  async complete() {
    if (this.running) return;
    const prompt = $("#prompt").value;
    const output = $("#completion-output");
    output.querySelector(".prompt-text").textContent = prompt;
    const generated = output.querySelector(".generated");
    generated.textContent = "";
    const outcome = await this.stream("/v1/completions", { prompt }, (choice) => {
      if (choice.text) generated.textContent += choice.text;
    }, output);
    output.dataset.outcome = outcome;
  }

  // Streams one request; onChoice(choice) per chunk's first choice. Returns "done",
  // "stopped" or "error", and leaves the figures in #answer-stats.
  async stream(path, fields, onChoice, target) {
    const clock = new AnswerClock();
    const controller = new AbortController();
    this.running = controller;
    this.setBusy(true);
    target.dataset.outcome = "streaming";
    let outcome = "done";
    let note = "";
    try {
      // Usage on every chunk, not only after the last: a stopped answer's tokens
      // are counted too.
      const body = { model: this.model(), ...samplingBody(), ...fields, stream: true,
        stream_options: { include_usage: true, continuous_usage_stats: true } };
      await postStream(path, body, (chunk) => {
        if (chunk.usage) clock.usage = chunk.usage;
        const choice = (chunk.choices || [])[0];
        if (choice) {
          clock.chunk();
          onChoice(choice);
        }
      }, controller.signal, (engineId) => {
        if (engineId) {
          target.dataset.requestId = engineId;
          this.onRequest(engineId);
        }
      });
    } catch (error) {
      if (error.name === "AbortError") {
        outcome = "stopped";
        note = "stopped";
        target.append(el("div", { className: "note", text: "stopped" }));
      } else {
        outcome = "error";
        note = error instanceof ApiError || error instanceof SyntaxError ? error.message : String(error);
        target.append(el("div", { className: "error", text: note }));
      }
    } finally {
      this.running = null;
      this.setBusy(false);
    }
    $("#answer-stats").textContent = clock.summary(note);
    return outcome;
  }
}
