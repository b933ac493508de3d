// The tinyvllm dashboard: reads /v1/engine/state/stream (server-sent events) and draws each snapshot.
//
// The stream is read with fetch(), not EventSource, because EventSource cannot send the Authorization
// header that a server started with --api-key wants. The key comes from #key=... (the address's fragment,
// which the browser never sends, so it reaches no server log; then dropped from the address bar) or the
// form, and is kept in this browser's localStorage; it is sent to this page's own origin only (the server
// itself, or `python -m tinyvllm.dashboard`, which passes it on). An old ?key=... link still works, but
// the server's access log then shows the parameter redacted (tinyvllm/api/access_log.py).
"use strict";

const KEY_STORAGE = "tinyvllm.dashboard.key";
const INTERVAL_S = 0.25;
const $ = (id) => document.getElementById(id);

function takeKeyFromAddress() {
  const url = new URL(window.location.href);
  const fragment = new URLSearchParams(url.hash.slice(1));
  const key = fragment.get("key") ?? url.searchParams.get("key");
  if (key !== null) {
    localStorage.setItem(KEY_STORAGE, key);
    url.searchParams.delete("key");
    url.hash = "";
    history.replaceState(null, "", url);
  }
}

function setStatus(state, text) {
  $("status").dataset.state = state;
  $("status").textContent = text;
}

// ---- the stream ----

async function connect() {
  const key = localStorage.getItem(KEY_STORAGE);
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  try {
    const response = await fetch(`/v1/engine/state/stream?interval=${INTERVAL_S}`, { headers, cache: "no-store" });
    if (response.status === 401) {
      setStatus("error", key ? "wrong API key" : "API key needed");
      $("key-form").hidden = false;
      return; // the form's submit connects again
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    $("key-form").hidden = true;
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) { // one event per blank-line-terminated block
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
        if (data) onEvent(JSON.parse(data));
      }
    }
    setStatus("error", "stream ended: reconnecting");
  } catch (error) {
    setStatus("error", `disconnected (${error.message}): reconnecting`);
  }
  setTimeout(connect, 1000);
}

function onEvent(state) {
  if (state.error) { // the engine is loading or stopped: the stream goes on
    setStatus("error", state.error.message);
    return;
  }
  setStatus("live", state.server && state.server.draining ? "live (draining)" : "live");
  drawConfig(state.config || {}, state.stats || {});
  drawRates(state.rates || {}, state.stats || {});
  drawBlocks(state.kv_cache, state.running || []);
  drawEncoderCache(state.encoder_cache);
  drawQueue("running", state.running || [], (r) => r.block_table.length);
  drawQueue("waiting", state.waiting || [], (r) => `${r.age_s.toFixed(1)} s`);
  drawSteps(state.steps || [], state.num_steps || 0, state.config || {});
}

// ---- panels ----

function ownerColour(requestId, alpha = 1) { // one stable colour per request id
  let h = 0;
  for (const c of requestId) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return `hsla(${h % 360}, 65%, ${45 + (h >> 9) % 20}%, ${alpha})`;
}

function drawConfig(config, stats) {
  $("cfg-model").textContent = config.model ?? "-";
  $("cfg-quantization").textContent = config.quantization ?? stats.quantization ?? "-";
  $("cfg-dtype").textContent = config.dtype ?? "-";
  $("cfg-kv-dtype").textContent = config.kv_cache_dtype ?? "-";
  $("cfg-device").textContent = config.device ?? "-";
  $("cfg-blocks").textContent = config.num_blocks ? `${config.num_blocks} x ${config.block_size} tokens` : "-";
  $("cfg-limits").textContent = config.max_num_seqs
    ? `${config.max_num_seqs} seqs, ${config.max_num_batched_tokens} tokens, ${config.scheduling_policy}` : "-";
}

const fmt = (x, digits = 0) => (x === null || x === undefined ? "-" : Number(x).toFixed(digits));

function drawRates(rates, stats) {
  $("rates-window").textContent = rates.window_s ? `over the last ${rates.window_s.toFixed(1)} s` : "";
  $("rate-generation").textContent = fmt(rates.generation_tok_s, 1);
  $("rate-prompt").textContent = fmt(rates.prompt_tok_s, 1);
  $("rate-ttft").textContent = `${fmt(rates.ttft_p50_ms)} / ${fmt(rates.ttft_p99_ms)}`;
  $("rate-itl").textContent = `${fmt(rates.itl_p50_ms)} / ${fmt(rates.itl_p99_ms)}`;
  $("rate-prefix").textContent = rates.prefix_cache_hit_rate == null ? "-" : `${fmt(rates.prefix_cache_hit_rate * 100)}%`;
  const spec = rates.spec_decode_acceptance_rate;
  $("tile-spec").hidden = spec === undefined;
  if (spec !== undefined) $("rate-spec").textContent = `${fmt(spec * 100)}%`;
  const total = stats.num_total_blocks;
  $("rate-kv").textContent = total ? `${total - stats.num_free_blocks} / ${total}` : "-";
}

function drawBlocks(kv, running) {
  const grid = $("blocks");
  if (!kv) { grid.textContent = "this engine does not report its blocks"; return; }
  const n = kv.ref_cnt.length;
  if (grid.childElementCount !== n) {
    grid.textContent = "";
    for (let i = 0; i < n; i++) grid.appendChild(Object.assign(document.createElement("div"), { className: "block" }));
  }
  const owners = Array.from({ length: n }, () => []);
  for (const r of running) for (const b of r.block_table) owners[b].push(r.request_id);
  let used = 0, shared = 0, cachedFree = 0;
  for (let i = 0; i < n; i++) {
    const cell = grid.children[i], ref = kv.ref_cnt[i], cached = kv.cached[i] === 1;
    let kind = "free";
    if (ref > 1) kind = "shared";
    else if (ref === 1) kind = "owned";
    else if (cached) kind = "cached";
    cell.className = `block ${kind}` + (ref > 0 && cached ? " in-cache" : "");
    cell.style.backgroundColor = ref > 0 && owners[i].length ? ownerColour(owners[i][0]) : "";
    cell.dataset.ref = ref;
    cell.dataset.cached = cached ? 1 : 0;
    cell.title = `block ${i}: ref_cnt ${ref}${cached ? ", prefix-cached" : ""}` +
      (owners[i].length ? `\n${owners[i].join("\n")}` : "");
    used += ref > 0;
    shared += ref > 1;
    cachedFree += ref === 0 && cached;
  }
  $("blocks-summary").textContent =
    `${used} in use (${shared} shared), ${cachedFree} free but cached, ${kv.num_free_blocks} free of ${n}`;
  grid.dataset.used = used;
}

function drawEncoderCache(cache) { // Phase 10: images' encoder outputs, kept by content hash
  $("encoder-panel").hidden = !cache;
  if (!cache) return;
  const used = cache.cache_size - cache.num_free_slots;
  $("encoder-summary").textContent = `${cache.entries.length} images, room for ${cache.cache_size} embeddings`;
  $("encoder-used").textContent = `${used} / ${cache.cache_size}`;
  $("encoder-hits").textContent = `${cache.num_hits} / ${cache.num_queries}`;
  $("encoder-runs").textContent = cache.num_encoder_runs;
  $("encoder-entries").tBodies[0].innerHTML = cache.entries.map((e) => `<tr data-freeable="${e.freeable}">
    <td class="id">${escape(e.mm_hash)}</td><td>${e.num_embeds}</td>
    <td>${e.requests.length ? e.requests.map(escape).join(", ") : "none (evicted when its room is needed)"}</td></tr>`
  ).join("");
}

function drawQueue(name, requests, lastColumn) {
  $(`${name}-count`).textContent = requests.length;
  const rows = requests.map((r) => {
    const done = r.num_tokens ? (100 * r.num_computed_tokens) / r.num_tokens : 0;
    return `<tr data-request-id="${escape(r.request_id)}">
      <td><span class="swatch" style="background:${ownerColour(r.request_id)}"></span></td>
      <td class="id" title="${escape(r.request_id)}">${escape(r.request_id)}</td><td>${r.status}</td><td>${r.priority}</td>
      <td><span class="progress"><span style="width:${done.toFixed(1)}%"></span></span>${r.num_computed_tokens} / ${r.num_tokens}</td>
      <td>${r.num_prompt_tokens} + ${r.num_output_tokens}${r.num_cached_tokens ? ` (${r.num_cached_tokens} cached)` : ""}</td>
      <td>${lastColumn(r)}</td></tr>`;
  });
  $(name).tBodies[0].innerHTML = rows.join("");
}

function drawSteps(steps, numSteps, config) {
  const last = steps.slice(-90);
  $("steps-summary").textContent = `${numSteps} steps so far`;
  const canvas = $("steps-chart"), ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, barW = w / 90;
  ctx.clearRect(0, 0, w, h);
  const maxTokens = Math.max(1, config.max_num_batched_tokens || 0, ...last.map((s) => s.num_prefill_tokens + s.num_decode_tokens));
  const maxMs = Math.max(1, ...last.map((s) => s.step_ms));
  last.forEach((s, i) => {
    const x = i * barW, decode = (s.num_decode_tokens / maxTokens) * h, prefill = (s.num_prefill_tokens / maxTokens) * h;
    ctx.fillStyle = getComputedStyle(document.body).getPropertyValue("--decode");
    ctx.fillRect(x, h - decode, barW - 1, decode);
    ctx.fillStyle = getComputedStyle(document.body).getPropertyValue("--prefill");
    ctx.fillRect(x, h - decode - prefill, barW - 1, prefill);
    if (s.num_preempted) {
      ctx.fillStyle = getComputedStyle(document.body).getPropertyValue("--preempt");
      ctx.fillRect(x, 0, barW - 1, 6);
    }
  });
  ctx.strokeStyle = getComputedStyle(document.body).getPropertyValue("--steptime");
  ctx.beginPath();
  last.forEach((s, i) => ctx[i ? "lineTo" : "moveTo"](i * barW + barW / 2, h - (s.step_ms / maxMs) * (h - 8)));
  ctx.stroke();
  ctx.fillStyle = "#6b7385";
  ctx.fillText(`${maxTokens} tokens / ${maxMs.toFixed(0)} ms`, 4, 12);
  $("steps").tBodies[0].innerHTML = last.slice(-8).reverse().map((s, i) => `<tr><td>${numSteps - i}</td>
    <td>${s.batch_size}</td><td>${s.num_prefill_tokens}</td><td>${s.num_decode_tokens}</td><td>${s.num_preempted}</td>
    <td>${s.step_ms.toFixed(1)}</td></tr>`).join("");
}

function escape(text) {
  return String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  localStorage.setItem(KEY_STORAGE, $("key-input").value);
  $("key-form").hidden = true;
  setStatus("connecting", "connecting");
  connect();
});

takeKeyFromAddress();
connect();
