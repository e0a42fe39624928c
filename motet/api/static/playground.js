// The motet playground: a chat page over this server's OpenAI-compatible API (no build step, no libraries).
// Text from the model or the server is only ever set as textContent, never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const STORED_KEY = "motet.apiKey";
const STORED_MODEL = "motet.model";

const EXAMPLE_SCHEMA = {
  type: "object",
  properties: { city: { type: "string" }, population: { type: "integer" } },
  required: ["city", "population"],
  additionalProperties: false,
};
const EXAMPLE_TOOLS = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "The current weather in a city",
      parameters: {
        type: "object",
        properties: { city: { type: "string" }, unit: { type: "string", enum: ["celsius", "fahrenheit"] } },
        required: ["city"],
      },
    },
  },
];

const history = []; // the conversation as sent to the API, without the system prompt
let inflight = null; // the AbortController of the request being streamed
let conversation = 0; // bumped by "New chat", so that a reply still streaming is not added to the new one

// -- the API ---------------------------------------------------------------------------------------------
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// An error response as one line: the status and the API's error.message (OpenAI's error shape).
async function describeError(resp) {
  let message = resp.statusText;
  try {
    const body = await resp.json();
    message = body?.error?.message ?? JSON.stringify(body);
  } catch {
    // not JSON: keep the status text
  }
  return `Error ${resp.status}: ${message}`;
}

// The `data:` payloads of a server-sent event stream, as they arrive.
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
  }
}

async function loadModels() {
  const select = $("model");
  const wanted = select.value || localStorage.getItem(STORED_MODEL);
  clearError();
  let resp;
  try {
    resp = await fetch("v1/models", { headers: headers() });
  } catch (e) {
    return showError(`Cannot reach the server: ${e.message}`);
  }
  if (!resp.ok) return showError(await describeError(resp));
  const { data } = await resp.json();
  select.replaceChildren(
    ...data.map((m) => new Option(m.parent ? `${m.id} (adapter of ${m.parent})` : m.id, m.id))
  );
  if (data.some((m) => m.id === wanted)) select.value = wanted;
}

// -- settings --------------------------------------------------------------------------------------------
function parseJSONSetting(id, what) {
  try {
    return JSON.parse($(id).value);
  } catch (e) {
    throw new Error(`${what} is not valid JSON: ${e.message}`);
  }
}

function toolNames() {
  try {
    const tools = JSON.parse($("tools").value);
    if (!Array.isArray(tools)) return [];
    return tools.map((t) => t?.function?.name).filter((n) => typeof n === "string");
  } catch {
    return [];
  }
}

// tool_choice: auto / required / none, or one of the tools by name.
function refreshToolChoices() {
  const select = $("tool-choice");
  const current = select.value || "auto";
  const options = ["auto", "required", "none"].map((c) => new Option(c, c));
  for (const name of toolNames()) options.push(new Option(`function: ${name}`, `function:${name}`));
  select.replaceChildren(...options);
  select.value = options.some((o) => o.value === current) ? current : "auto";
}

function showMode() {
  $("schema-settings").hidden = $("mode").value !== "schema";
  $("tools-settings").hidden = $("mode").value !== "tools";
}

function requestBody(messages) {
  const body = { model: $("model").value, messages, stream: true, stream_options: { include_usage: true } };
  const system = $("system-prompt").value.trim();
  if (system) body.messages = [{ role: "system", content: system }, ...messages];
  const temperature = $("temperature").valueAsNumber;
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  const maxTokens = $("max-tokens").valueAsNumber;
  if (!Number.isNaN(maxTokens)) body.max_tokens = maxTokens;
  const mode = $("mode").value;
  if (mode === "schema") {
    const schema = parseJSONSetting("json-schema", "The JSON schema");
    body.response_format = { type: "json_schema", json_schema: { name: "playground", schema } };
  } else if (mode === "tools") {
    body.tools = parseJSONSetting("tools", "The tools");
    const choice = $("tool-choice").value;
    body.tool_choice = choice.startsWith("function:")
      ? { type: "function", function: { name: choice.slice("function:".length) } }
      : choice;
    body.parallel_tool_calls = $("parallel-tool-calls").checked;
  }
  return body;
}

// -- the conversation ------------------------------------------------------------------------------------
function showError(text) {
  $("error").textContent = text;
  $("error").hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

function scrollToEnd() {
  const log = $("messages");
  log.scrollTop = log.scrollHeight;
}

// One message on the page: its role, reasoning (folded), text, tool calls and a meta line.
function addMessage(role, label) {
  const article = element("article", `message ${role}`);
  article.append(element("h2", "role", label));
  const reasoning = element("details", "reasoning");
  reasoning.append(element("summary", "", "Reasoning"), element("div", "reasoning-text"));
  reasoning.hidden = true;
  reasoning.open = true;
  const content = element("div", "content");
  const calls = element("div", "tool-calls");
  const meta = element("p", "meta");
  article.append(reasoning, content, calls, meta);
  $("messages").append(article);
  scrollToEnd();
  return { article, reasoning, content, calls, meta };
}

function renderToolCall(container, call) {
  let box = container.children[call.index];
  if (!box) {
    box = element("section", "tool-call");
    box.setAttribute("aria-label", "Tool call");
    box.append(element("h3", "tool-name"), element("pre", "tool-arguments"));
    container.append(box);
  }
  box.dataset.name = call.name;
  box.querySelector(".tool-name").textContent = call.name;
  box.querySelector(".tool-arguments").textContent = call.arguments;
}

function prettyJSON(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

// The tool calls of the last assistant message that no tool message answers yet.
function pendingToolCalls() {
  const last = history.findLastIndex((m) => m.role === "assistant");
  if (last < 0 || !history[last].tool_calls) return [];
  const answered = new Set(history.slice(last + 1).map((m) => m.tool_call_id));
  return history[last].tool_calls.filter((c) => !answered.has(c.id));
}

function updatePlaceholder() {
  const [call] = pendingToolCalls();
  $("prompt").placeholder = call
    ? `The result of ${call.function.name} (sent as a tool message; Enter to send)`
    : "Message (Enter to send, Shift+Enter for a new line)";
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("messages").setAttribute("aria-busy", String(busy));
}

async function send(text) {
  clearError();
  const [call] = pendingToolCalls();
  const message = call
    ? { role: "tool", tool_call_id: call.id, content: text }
    : { role: "user", content: text };
  let body;
  try {
    if (!$("model").value) throw new Error("No model: check the API key, then press Reload.");
    body = requestBody([...history, message]);
  } catch (e) {
    return showError(e.message);
  }
  $("prompt").value = "";
  const shown = addMessage(message.role, call ? `Tool result: ${call.function.name}` : "You");
  shown.content.textContent = text;
  const answer = addMessage("assistant", body.model);
  const calls = []; // tool calls by index: {index, id, name, arguments}
  let content = "";
  let finishReason = null;
  let usage = null;
  let stopped = false;

  const fail = (error) => {
    shown.article.remove();
    answer.article.remove();
    $("prompt").value = text; // to send again once fixed
    showError(error);
  };

  const turn = conversation;
  inflight = new AbortController();
  setBusy(true);
  try {
    const resp = await fetch("v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(body),
      signal: inflight.signal,
    });
    if (!resp.ok) return fail(await describeError(resp));
    for await (const data of sseData(resp.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) return fail(`Error: ${chunk.error.message}`); // the request failed midway
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices ?? []) {
        const delta = choice.delta ?? {};
        if (delta.reasoning_content) {
          answer.reasoning.hidden = false;
          answer.reasoning.querySelector(".reasoning-text").textContent += delta.reasoning_content;
        }
        if (delta.content) {
          content += delta.content;
          answer.content.textContent = content;
        }
        for (const d of delta.tool_calls ?? []) {
          const c = (calls[d.index] ??= { index: d.index, id: "", name: "", arguments: "" });
          c.id = d.id ?? c.id;
          c.name += d.function?.name ?? "";
          c.arguments += d.function?.arguments ?? "";
          renderToolCall(answer.calls, c);
        }
        if (choice.finish_reason) finishReason = choice.finish_reason;
      }
      scrollToEnd();
    }
  } catch (e) {
    if (e.name !== "AbortError") return fail(`The request failed: ${e.message}`); // network, or a bad event
    stopped = true;
  } finally {
    inflight = null;
    setBusy(false);
  }

  for (const c of calls) {
    c.arguments = prettyJSON(c.arguments);
    renderToolCall(answer.calls, c);
  }
  const parts = [stopped ? "stopped" : `finish: ${finishReason ?? "?"}`];
  if (usage) parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
  answer.meta.textContent = parts.join(" · ");
  answer.article.dataset.finished = stopped ? "stopped" : (finishReason ?? "unknown");

  if (turn !== conversation) return;
  const reply = { role: "assistant", content };
  if (calls.length && !stopped) {
    reply.tool_calls = calls.map((c) => ({
      id: c.id,
      type: "function",
      function: { name: c.name, arguments: c.arguments },
    }));
  }
  history.push(message, reply);
  updatePlaceholder();
  $("prompt").focus();
}

// -- wiring ----------------------------------------------------------------------------------------------
function init() {
  $("api-key").value = localStorage.getItem(STORED_KEY) ?? "";
  $("api-key").addEventListener("input", () => localStorage.setItem(STORED_KEY, $("api-key").value.trim()));
  $("api-key").addEventListener("change", loadModels);
  $("model").addEventListener("change", () => localStorage.setItem(STORED_MODEL, $("model").value));
  $("refresh-models").addEventListener("click", loadModels);

  $("json-schema").value = JSON.stringify(EXAMPLE_SCHEMA, null, 2);
  $("tools").value = JSON.stringify(EXAMPLE_TOOLS, null, 2);
  $("tools").addEventListener("input", refreshToolChoices);
  $("mode").addEventListener("change", showMode);
  refreshToolChoices();
  showMode();

  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value;
    if (text.trim() && !inflight) send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    } else if (e.key === "Escape" && inflight) {
      inflight.abort();
    }
  });
  $("stop").addEventListener("click", () => inflight?.abort());
  $("clear").addEventListener("click", () => {
    inflight?.abort();
    conversation += 1;
    history.length = 0;
    $("messages").replaceChildren();
    clearError();
    updatePlaceholder();
    $("prompt").focus();
  });
  loadModels();
}

init();
