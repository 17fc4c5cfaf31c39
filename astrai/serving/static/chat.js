// astrai chat page: streams replies from /v1/chat/completions (OpenAI protocol, SSE).
// No build step and no external resources: everything here is served by the astrai server.
"use strict";

const STRINGS = {
  en: {
    language: "Language", model: "Model", system: "System prompt", temperature: "Temperature", top_p: "Top-p",
    top_k: "Top-k (0 = off)", max_tokens: "Max new tokens", api_key: "API key (if the server needs one)",
    new_chat: "New chat", send: "Send", stop: "Stop", placeholder: "Type a message — Enter to send, Shift+Enter for a new line",
    thinking: "Generating…", stopped: "Stopped.", done: "Done", tokens: "tokens", error: "Error",
  },
  zh: {
    language: "语言", model: "模型", system: "系统提示词", temperature: "温度", top_p: "Top-p",
    top_k: "Top-k（0 表示关闭）", max_tokens: "最大生成长度", api_key: "API 密钥（服务器需要时填写）",
    new_chat: "新对话", send: "发送", stop: "停止", placeholder: "输入消息 — Enter 发送，Shift+Enter 换行",
    thinking: "生成中…", stopped: "已停止。", done: "完成", tokens: "个词元", error: "错误",
  },
};

const $ = (id) => document.getElementById(id);
const SETTINGS = ["system", "temperature", "top_p", "top_k", "max_tokens", "api_key", "lang"];
let lang = localStorage.getItem("astrai.lang") || (navigator.language.startsWith("zh") ? "zh" : "en");
let history = JSON.parse(localStorage.getItem("astrai.history") || "[]");
let modelName = null;
let controller = null;

function t(key) { return STRINGS[lang][key] || STRINGS.en[key] || key; }

function applyLanguage() {
  document.documentElement.lang = lang === "zh" ? "zh-CN" : "en";
  $("lang").value = lang;
  document.querySelectorAll("[data-i18n]").forEach((el) => { el.textContent = t(el.dataset.i18n); });
  document.querySelectorAll("[data-i18n-placeholder]").forEach((el) => { el.placeholder = t(el.dataset.i18nPlaceholder); });
}

function loadSettings() {
  for (const id of SETTINGS) {
    const saved = localStorage.getItem("astrai.setting." + id);
    if (saved !== null && id !== "lang") $(id).value = saved;
  }
  $("temperature-value").textContent = $("temperature").value;
  $("top_p-value").textContent = $("top_p").value;
}

function saveSettings() {
  for (const id of SETTINGS) localStorage.setItem("astrai.setting." + id, $(id).value);
  $("temperature-value").textContent = $("temperature").value;
  $("top_p-value").textContent = $("top_p").value;
}

function saveHistory() { localStorage.setItem("astrai.history", JSON.stringify(history)); }

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function addBubble(role, text) {
  const el = document.createElement("div");
  el.className = "message " + role;
  el.textContent = text;
  $("messages").appendChild(el);
  $("messages").scrollTop = $("messages").scrollHeight;
  return el;
}

function renderHistory() {
  $("messages").replaceChildren();
  for (const m of history) addBubble(m.role, m.content);
}

async function loadModel() {
  try {
    const res = await fetch("/v1/models", { headers: headers() });
    const body = await res.json();
    if (!res.ok) throw new Error(body.error ? body.error.message : res.statusText);
    modelName = body.data[0].id;
    $("model-name").textContent = modelName;
  } catch (err) {
    $("model-name").textContent = "?";
    $("status").textContent = t("error") + ": " + err.message;
  }
}

// Reads an SSE body and calls onData with each event's data payload.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = frame.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data === "[DONE]") return;
      if (data) onData(JSON.parse(data));
    }
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(text) {
  if (!modelName) await loadModel();
  history.push({ role: "user", content: text });
  addBubble("user", text);
  const reply = { role: "assistant", content: "" };
  const bubble = addBubble("assistant", "");
  bubble.classList.add("streaming");
  setBusy(true);
  $("status").textContent = t("thinking");
  controller = new AbortController();
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history);
  const body = {
    model: modelName, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), top_p: Number($("top_p").value),
    top_k: Number($("top_k").value) || 0, max_tokens: Number($("max_tokens").value) || 256,
  };
  let usage = null;
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!res.ok) {
      const err = await res.json().catch(() => ({}));
      throw new Error(err.error ? err.error.message : res.status + " " + res.statusText);
    }
    await readEvents(res, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const piece = choice.delta && choice.delta.content;
        if (piece) {
          reply.content += piece;
          bubble.textContent = reply.content;
          $("messages").scrollTop = $("messages").scrollHeight;
        }
      }
    });
    $("status").textContent = t("done") + (usage ? ` · ${usage.completion_tokens} ${t("tokens")}` : "");
  } catch (err) {
    if (err.name === "AbortError") {
      $("status").textContent = t("stopped");
    } else {
      addBubble("error", t("error") + ": " + err.message);
      $("status").textContent = "";
    }
  } finally {
    bubble.classList.remove("streaming");
    history.push(reply);
    saveHistory();
    controller = null;
    setBusy(false);
  }
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("new-chat").addEventListener("click", () => {
  if (controller) controller.abort();
  history = [];
  saveHistory();
  renderHistory();
  $("status").textContent = "";
});
$("lang").addEventListener("change", () => {
  lang = $("lang").value;
  localStorage.setItem("astrai.lang", lang);
  applyLanguage();
});
for (const id of SETTINGS) $(id).addEventListener("change", saveSettings);
$("temperature").addEventListener("input", saveSettings);
$("top_p").addEventListener("input", saveSettings);
$("api_key").addEventListener("change", loadModel);

loadSettings();
applyLanguage();
renderHistory();
loadModel();
