// What the page says of requests and answers: plain functions of the data the
// server sends, touching no page (tests/server/test_engine_view_text.py runs them
// in node).

import { formatSeconds } from "./dom.js";

export function count(n, noun) {
  return `${n} ${noun}${n === 1 ? "" : "s"}`;
}

// A sequence's progress in the request table: in decode, the tokens it generated
// against the most it may (max_tokens); before that, its known tokens (the prompt,
// or all of them again after a preemption) that have their KV computed.
export function requestProgress(r) {
  if (r.phase === "decode") {
    return { fraction: Math.min(1, r.output_tokens / Math.max(r.max_tokens, 1)),
      text: `${r.output_tokens} / ${r.max_tokens} generated` };
  }
  return { fraction: r.computed_tokens / Math.max(r.tokens, 1),
    text: `${r.computed_tokens} / ${r.tokens} computed` };
}

// A sequence in "Just finished": how it ended, and what came of it. An embedding
// generates nothing (its finish reason, "length", says nothing to a reader);
// output_tokens are those its client got.
export function finishedText(f) {
  if (f.embedding) {
    return { kind: "embedding", reason: "embedding",
      detail: `embedded ${count(f.prompt_tokens, "prompt token")}` };
  }
  if (f.reason === "abort") {
    return { kind: "abort", reason: "aborted", detail: `after ${count(f.output_tokens, "token")}` };
  }
  return { kind: f.reason, reason: f.reason, detail: count(f.output_tokens, "token") };
}

// The figures under a streamed answer. usage: the latest the stream reported (every
// chunk carries it: stream_options.continuous_usage_stats), so an answer stopped
// midway still counts its tokens; null when no chunk came. sent, first, last:
// performance.now() of the request, its first chunk and its last. note: "stopped",
// an error's message, or "".
export function answerStats({ usage, sent, first, last, note }) {
  const parts = [];
  const completion = usage ? usage.completion_tokens : 0; // no chunk: no token came
  if (usage) parts.push(count(usage.prompt_tokens, "prompt token"));
  if (usage || note === "stopped") parts.push(count(completion, "completion token"));
  if (first !== null) parts.push(`TTFT ${formatSeconds((first - sent) / 1000)}`);
  if (first !== null && last > first && completion > 1) {
    parts.push(`${((completion - 1) / ((last - first) / 1000)).toFixed(1)} tokens/s`);
  }
  if (note) parts.push(note);
  return parts.join(" · ");
}
