// pdrt's demo chat page. Plain browser JavaScript, no build step, no dependencies.
//
// Life cycle of one message, as the server sees it:
//   1. focus on the input box   -> POST /v1/pdrt/warmup: the server prefills the conversation so far;
//   2. the first key typed      -> POST /v1/pdrt/drafts: a draft whose prompt is the conversation plus
//                                  what the box reads, as the next user turn;
//   3. every later input event  -> PUT /v1/pdrt/drafts/{id} with the whole text; at most one PUT is in
//                                  flight per draft, later texts are coalesced into the next one;
//   4. Enter                    -> the last PUT completes, then POST /v1/pdrt/drafts/{id}/submit streams
//                                  the answer back as server-sent events;
//   an emptied box              -> DELETE /v1/pdrt/drafts/{id}.
// Where a draft fails (expired, say), the message goes to POST /v1/chat/completions instead.
"use strict";

const KEY_STORAGE = "pdrt-api-key";
const WARMUP_MIN_INTERVAL_MS = 1000; // refocusing the box more often than this sends nothing
const DEFAULT_SAMPLING = { max_tokens: 512, temperature: 0.7 };
const NUMERIC_QUERY_PARAMS = ["max_tokens", "temperature", "top_p", "seed"]; // overrides, e.g. ?temperature=0

const $ = (selector) => document.querySelector(selector);
const ui = { status: $("#status"), conversation: $("#conversation"), form: $("#composer"), input: $("#input"),
             send: $("#send") };

// ---- settings from the URL -------------------------------------------------------------------------------

/** An API key given as ?key=... is kept for this tab only and taken out of the address bar. */
function takeApiKey(query) {
  if (query.has("key")) {
    sessionStorage.setItem(KEY_STORAGE, query.get("key"));
    query.delete("key");
    const rest = query.toString();
    history.replaceState(null, "", location.pathname + (rest ? `?${rest}` : "") + location.hash);
  }
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

function samplingFrom(query) {
  const sampling = { ...DEFAULT_SAMPLING };
  for (const name of NUMERIC_QUERY_PARAMS) {
    if (query.has(name) && query.get(name) !== "" && !Number.isNaN(Number(query.get(name)))) {
      sampling[name] = Number(query.get(name));
    }
  }
  return sampling;
}

/** crypto.randomUUID exists only in secure contexts (https, localhost); a page served over plain http
 *  on a LAN address builds the same version-4 UUID from getRandomValues. */
function newSessionId() {
  if (crypto.randomUUID) return crypto.randomUUID();
  const b = crypto.getRandomValues(new Uint8Array(16));
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  const hex = Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

const query = new URLSearchParams(location.search);
const apiKey = takeApiKey(query);
const sampling = samplingFrom(query);
const sessionId = newSessionId();

// ---- HTTP ---------------------------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** fetch() with the API key and a JSON body; a 4xx/5xx answer becomes an ApiError with the server's message. */
async function api(method, path, body, options = {}) {
  const headers = {};
  if (body !== undefined) headers["Content-Type"] = "application/json";
  if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
  const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body),
                                       ...options });
  if (!response.ok) throw await apiError(response);
  return response;
}

async function apiError(response) {
  let code = null;
  let message = `${response.status} ${response.statusText}`;
  try {
    const { error } = await response.json();  // OpenAI's shape: {"error": {"message", "type", "code"}}
    if (error?.message) message = error.message;
    code = error?.code ?? null;
  } catch { /* not JSON: keep the status line */ }
  return new ApiError(response.status, code, message);
}

/** The `data:` payloads of a server-sent-event stream, one per event. */
async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = /\r?\n\r?\n/.exec(buffer)) !== null) {
      const event = buffer.slice(0, end.index);
      buffer = buffer.slice(end.index + end[0].length);
      const data = event.split(/\r?\n/).filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(line.startsWith("data: ") ? 6 : 5));
      if (data.length) yield data.join("\n");
    }
  }
}

// ---- drafts -------------------------------------------------------------------------------------------------

/** The message being typed, mirrored on the server so that it can prefill it before Enter. */
class Draft {
  constructor(messages) {
    this.id = api("POST", "/v1/pdrt/drafts", { messages, session_id: sessionId })
      .then((response) => response.json()).then((body) => body.draft_id);
    this.id.catch(() => {}); // a failed open is reported by flush(), and submit() falls back
    this.latest = "";        // what the input box reads
    this.sent = "";          // what the server has
    this.sending = null;     // the PUT loop, while one runs
    this.error = null;
    this.numUpdates = 0;
  }

  path(id, suffix = "") {
    return `/v1/pdrt/drafts/${encodeURIComponent(id)}${suffix}`;
  }

  /** The box now reads `text`. Returns a promise of the moment the server has it (or the draft failed). */
  setText(text) {
    this.latest = text;
    if (!this.sending && !this.error) this.sending = this.flush();
    return this.sending ?? Promise.resolve();
  }

  async flush() {
    try {
      const id = await this.id;
      while (this.latest !== this.sent && !this.error) {
        const text = this.latest;
        await api("PUT", this.path(id), { text });
        this.sent = text;
        this.numUpdates += 1;
      }
    } catch (error) {
      this.error = error;
    } finally {
      this.sending = null;
    }
  }

  /** The answer to the draft's final text, as the streaming response of a chat completion. */
  async submit(text, params) {
    await this.setText(text);
    if (this.error) throw this.error;
    return api("POST", this.path(await this.id, "/submit"), params);
  }

  abandon() {
    this.error ??= new Error("abandoned"); // stops the PUT loop; a PUT still in flight goes before the DELETE
    const sent = this.sending ?? Promise.resolve();
    // keepalive lets the DELETE outlive the page when it is being closed.
    Promise.all([this.id, sent]).then(([id]) => api("DELETE", this.path(id), undefined, { keepalive: true }))
      .catch(() => {});
  }
}

// ---- the page -----------------------------------------------------------------------------------------------

let conversation = []; // the finished turns, as the server's chat template gets them
let draft = null;
let busy = false;       // an answer is streaming; typing goes on, the next draft opens when it ends
let lastWarmupAt = -Infinity;
let model = "";

function setStatus(...parts) {
  ui.status.textContent = [model || "no model", ...parts].filter(Boolean).join(" · ");
}

/** A new entry in the conversation; returns its parts. */
function showMessage(role, text) {
  const item = document.createElement("li");
  item.className = `message ${role}`;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = role === "user" ? "You" : model || "Assistant";
  const content = document.createElement("p");
  content.className = "content";
  content.textContent = text;
  const meta = document.createElement("span");
  meta.className = "meta";
  item.append(label, content, meta);
  ui.conversation.append(item);
  item.scrollIntoView({ block: "end" });
  return { item, content, meta };
}

function warmUp() {
  if (performance.now() - lastWarmupAt < WARMUP_MIN_INTERVAL_MS) return;
  lastWarmupAt = performance.now();
  api("POST", "/v1/pdrt/warmup", { session_id: sessionId })
    .then(() => setStatus("warmed up"))
    .catch((error) => setStatus(`warmup failed: ${error.message}`));
}

function onInput() {
  if (busy) return; // the draft must hold the answer being streamed; it opens when the answer ends
  const text = ui.input.value;
  if (!text) {
    draft?.abandon();
    draft = null;
    return;
  }
  draft ??= new Draft(conversation);
  draft.setText(text);
}

async function chatCompletion(messages, params) {
  return api("POST", "/v1/chat/completions", { messages, session_id: sessionId, ...params });
}

/** Streams a chat-completion response into `reply`; returns the text, the TTFT and the usage. */
async function streamInto(reply, response, startedAt) {
  let text = "";
  let ttftMs = null;
  let usage = null;
  let finishReason = null;
  for await (const data of sseData(response)) {
    if (data === "[DONE]") break;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new ApiError(0, chunk.error.code, chunk.error.message);
    const choice = chunk.choices?.[0];
    const delta = choice?.delta?.content;
    if (delta) {
      if (ttftMs === null) {
        ttftMs = Math.round(performance.now() - startedAt);
        reply.item.dataset.ttftMs = String(ttftMs);
        reply.meta.textContent = `TTFT ${ttftMs} ms`;
      }
      text += delta;
      reply.content.textContent = text;
      reply.item.scrollIntoView({ block: "end" });
    }
    finishReason = choice?.finish_reason ?? finishReason;
    usage = chunk.usage ?? usage;
  }
  return { text, ttftMs, usage, finishReason };
}

function describe(answer, numUpdates) {
  const parts = [answer.ttftMs === null ? "no text" : `TTFT ${answer.ttftMs} ms`];
  if (answer.usage) {
    parts.push(`${answer.usage.completion_tokens} tokens`);
    const cached = answer.usage.prompt_tokens_details?.cached_tokens;
    if (cached) parts.push(`${cached} of ${answer.usage.prompt_tokens} prompt tokens cached`);
  }
  if (answer.finishReason === "length") parts.push("cut at max_tokens");
  if (numUpdates === null) parts.push("sent at Enter");
  else parts.push(`typed ahead in ${numUpdates} update${numUpdates === 1 ? "" : "s"}`);
  return parts.join(" · ");
}

async function send() {
  const startedAt = performance.now();
  const text = ui.input.value;
  if (busy || !text.trim()) return;
  busy = true;
  ui.send.disabled = true;
  const typed = draft;
  draft = null;
  ui.input.value = "";
  const messages = [...conversation, { role: "user", content: text }];
  const params = { ...sampling, stream: true, stream_options: { include_usage: true } };
  showMessage("user", text);
  const reply = showMessage("assistant", "");
  reply.item.setAttribute("aria-busy", "true");
  let numUpdates = null;
  try {
    let response;
    try {
      response = typed ? await typed.submit(text, params) : await chatCompletion(messages, params);
      numUpdates = typed ? typed.numUpdates : null;
    } catch (error) {
      if (!typed || error.status === 401) throw error;
      response = await chatCompletion(messages, params); // the draft expired or failed: send it whole
    }
    const answer = await streamInto(reply, response, startedAt);
    conversation = [...messages, { role: "assistant", content: answer.text }];
    reply.meta.textContent = describe(answer, numUpdates);
    reply.item.scrollIntoView({ block: "end" });
    setStatus(`last answer: TTFT ${answer.ttftMs ?? "–"} ms`, numUpdates === null ? "sent at Enter" : "typed ahead");
  } catch (error) {
    reply.item.classList.add("error");
    reply.meta.textContent = `Error: ${error.message}`;
    reply.meta.setAttribute("role", "alert");
    if (!ui.input.value) ui.input.value = text; // not in the conversation: give it back to edit and resend
  } finally {
    reply.item.setAttribute("aria-busy", "false");
    busy = false;
    ui.send.disabled = false;
    onInput(); // what was typed while the answer streamed becomes the next draft
  }
}

async function loadModel() {
  try {
    const { data } = await (await api("GET", "/v1/models")).json();
    model = data?.[0]?.id ?? "";
    setStatus("ready");
  } catch (error) {
    setStatus(`cannot list the models: ${error.message}`);
  }
}

ui.input.addEventListener("focus", warmUp);
ui.input.addEventListener("input", onInput);
ui.input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
ui.form.addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
window.addEventListener("pagehide", () => draft?.abandon());
loadModel();
