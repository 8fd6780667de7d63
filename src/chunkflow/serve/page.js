"use strict";
const VIDEO = __VIDEO__;
const FIELDS = ["prompt", "negative_prompt", "seed", "steps", "width", "height", "frames", "guidance", "image"];
const PHASES = {encode: "encoding the prompt", denoise: "denoising", decode: "decoding", write: "writing the output"};
const cards = new Map();  // job id -> its card, kept while the job is listed (a shown result is not fetched again)
let PLAN = null;          // GET /plan, once
let pollTimer = null;
const TOKEN = (() => {  // the server's token, if it has one: from the fragment once, then the tab's sessionStorage
  const m = /(?:^#|&)token=([^&]*)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem("chunkflow-token", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem("chunkflow-token");
})();

function $(id) { return document.getElementById(id); }

function api(path, options) {
  const headers = Object.assign({}, (options && options.headers) || {});
  if (TOKEN) headers["Authorization"] = "Bearer " + TOKEN;
  return fetch(path, Object.assign({cache: "no-store"}, options || {}, {headers: headers}));
}

function el(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined && text !== null) e.textContent = text;
  return e;
}

function say(text, error) {
  const m = $("message");
  m.textContent = text;
  m.className = "wide" + (error ? " error" : "");
}

function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }

function seconds(s) {
  if (s === null || s === undefined) return "";
  if (s < 1) return (s * 1000).toFixed(s < 0.01 ? 2 : 0) + " ms";
  if (s < 120) return s.toFixed(s < 10 ? 2 : 1) + " s";
  return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s";
}

function fromNow(t) {
  const d = t - Date.now() / 1000;
  return clock(t) + (d > 1 ? " (in " + seconds(d) + ")" : "");
}

// -- the plan: the form's fields and defaults, the plan panel ---------------------------------------------------
function setDefaults(force) {
  if (!PLAN) return;
  const d = PLAN.form.defaults, lim = PLAN.form.limits;
  for (const [name, value] of Object.entries(d)) {
    const input = $(name);
    if (!input || value === null || value === undefined) continue;
    input.placeholder = String(value);
    if (force || !input.dataset.touched) input.value = String(value);
  }
  $("width").step = String(lim.width_step);
  $("height").step = String(lim.height_step);
  $("steps").max = String(lim.max_steps);
  if ($("frames") && lim.frames_step) $("frames").step = String(lim.frames_step);
  const hints = ["width a multiple of " + lim.width_step, "height a multiple of " + lim.height_step];
  if (lim.frames_step) hints.push("frames 1 more than a multiple of " + lim.frames_step);
  $("form-hint").textContent = "The plan's defaults are filled in; " + hints.join(", ") + ". A job that does not " +
    "fit the loaded placement is refused with the planner's reason.";
}

function row(tbody, cells) {
  const tr = document.createElement("tr");
  for (const [text, cls] of cells) tr.appendChild(el("td", cls || "", text));
  tbody.appendChild(tr);
  return tr;
}

function renderPlan(p) {
  const pr = p.prediction;
  $("plan-note").textContent = p.predicts ? "The plan predicts this device: its times below are predictions." :
    p.prediction_note + "." + (p.nominal ? " The times below are the plan's nominal figures." : "");
  const dl = $("plan-summary");
  dl.replaceChildren();
  const items = [
    ["Model", p.model, "model"], ["Runs on", p.device, "device"], ["Planned for", p.hardware, "hardware"],
    ["Offload", p.offload, "offload"],
    ["Plan's shape", p.workload.width + "x" + p.workload.height + (VIDEO ? " x" + p.workload.frames + " frames" : "") +
      ", " + p.workload.steps + " steps", "shape"],
    ["Predicted step", pr.step_time.text, "step-time"],
    ["Predicted generation", pr.generation_time.text + (pr.startup.text ? " (first; " + pr.startup.text +
      " of it start-up)" : ""), "generation-time"],
    ["Host memory", pr.host_memory.text + (pr.host_budget.text ? " of " + pr.host_budget.text + " budget" : ""),
      "host-memory"],
  ];
  if (pr.device_budget.text) items.push([pr.device_word.replace(/^d/, "D") + " budget", pr.device_budget.text, "device-budget"]);
  for (const [k, v, key] of items) {
    if (v === null || v === undefined) continue;
    dl.appendChild(el("dt", "", k));
    const dd = el("dd", "", v);
    dd.dataset.key = key;
    dl.appendChild(dd);
  }
  const comps = document.querySelector("#plan-components tbody");
  comps.replaceChildren();
  for (const c of p.components) {
    const tr = row(comps, [[c.name], [c.runs_on], [c.held_in],
                           [c.bytes_text, "num"], [c.host_text || "-", "num"], [c.disk_read_text || "-", "num"]]);
    tr.dataset.component = c.name;
    tr.dataset.placement = c.placement;
    tr.dataset.bytes = String(c.bytes);
  }
  $("peak-head").textContent = "Peak " + pr.device_word + " memory";
  const phases = document.querySelector("#plan-phases tbody");
  phases.replaceChildren();
  for (const ph of pr.phases) {
    row(phases, [[ph.name], [ph.time.text, "num"], [ph.peak_memory.text, "num"]]).dataset.phase = ph.name;
  }
}

async function loadPlan() {
  const r = await api("/plan");
  if (!r.ok) return;
  PLAN = await r.json();
  renderPlan(PLAN);
  setDefaults(false);
  const model = $("model");
  if (!model.textContent) { model.textContent = PLAN.model; document.title += ": " + PLAN.model; }
}

// -- the jobs -----------------------------------------------------------------------------------------------------
function stateText(job) {
  let s = job.state;
  if (job.state === "queued" && job.position !== null) s += " (#" + (job.position + 1) + ")";
  if (job.cancel_requested && job.state === "running") s += ", cancelling";
  return s;
}

function settingsText(job) {
  const s = job.settings || {};
  const parts = ["seed " + s.seed, s.steps + " steps", s.width + "x" + s.height];
  if (s.frames !== null && s.frames !== undefined) parts.push(s.frames + " frames");
  if (s.guidance !== null && s.guidance !== undefined) parts.push("guidance " + s.guidance);
  if (s.negative_prompt) parts.push("negative: " + s.negative_prompt);
  if (s.cache) parts.push("cache " + s.cache);
  const c = job.cache;
  if (c) parts.push(c.blocks_skipped + " of " + (c.blocks_computed + c.blocks_skipped) + " block runs skipped");
  return parts.join(" · ");
}

function timesText(job) {
  const none = "no prediction";
  if (job.state === "queued" || job.state === "running") {
    if (job.predicted_finish === null) return none;
    const start = job.state === "queued" ? "starts " + fromNow(job.predicted_start) : "started " + clock(job.started);
    return "predicted: " + start + ", finishes " + fromNow(job.predicted_finish) + " (" + seconds(job.predicted_s) + ")";
  }
  if (job.seconds === null) return job.finished ? "ended " + clock(job.finished) : "";
  let t = "measured " + seconds(job.seconds);
  if (job.predicted_s) {
    const off = (job.seconds - job.predicted_s) / job.predicted_s * 100;
    t += " vs predicted " + seconds(job.predicted_s) + " (" + (off >= 0 ? "+" : "") + off.toFixed(0) + "%)";
  } else t += "; " + none;
  return t + " · finished " + clock(job.finished);
}

function copyId(id, button) {
  const done = () => { button.textContent = "copied"; setTimeout(() => { button.textContent = "copy"; }, 1500); };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(id).then(done, () => selectId(id));
  } else selectId(id);
}

function selectId(id) {  // no clipboard (a plain-HTTP remote page): select the id for Ctrl-C
  const code = document.querySelector('.job[data-id="' + id + '"] .job-id');
  const range = document.createRange();
  range.selectNodeContents(code);
  const sel = window.getSelection();
  sel.removeAllRanges();
  sel.addRange(range);
}

function newCard(job) {
  const card = el("article", "job");
  card.dataset.id = job.id;
  const head = el("div", "job-head");
  card.parts = {state: el("span", "state"), id: el("code", "job-id", job.id), copy: el("button", "copy", "copy"),
                cancel: el("button", "cancel", "Cancel"), prompt: el("p", "prompt", job.prompt),
                settings: el("p", "settings", settingsText(job)), progress: el("div", "progress"),
                times: el("p", "times"), error: el("p", "error-text"), result: el("div", "result")};
  const p = card.parts;
  p.copy.type = p.cancel.type = "button";
  p.copy.title = "copy the job id";
  p.copy.addEventListener("click", () => copyId(job.id, p.copy));
  p.cancel.addEventListener("click", () => cancel(job.id));
  head.append(p.state, p.id, p.copy, p.cancel);
  card.append(head, p.prompt, p.settings, p.progress, p.times, p.error, p.result);
  return card;
}

function updateProgress(card, job) {
  const box = card.parts.progress;
  if (job.state !== "running") { box.replaceChildren(); return; }
  let bar = box.querySelector("progress");
  if (!bar) { box.replaceChildren(el("progress"), el("span", "progress-text")); bar = box.querySelector("progress"); }
  bar.max = 1;
  bar.value = job.progress || 0;
  const what = PHASES[job.phase] || "starting";
  const steps = job.steps_total ? " · step " + job.step + "/" + job.steps_total : "";
  box.querySelector(".progress-text").textContent = " " + what + steps;
}

async function showResult(card, job) {
  const s = job.settings || {};
  const media = el(VIDEO ? "video" : "img");
  if (s.width && s.height) { media.width = s.width; media.height = s.height; }
  if (VIDEO) { media.controls = true; media.loop = true; media.muted = true; } else media.alt = job.prompt;
  const name = job.output || (job.id + (VIDEO ? ".mp4" : ".png"));
  const link = el("a", "download", "Download " + name);
  link.download = name;
  let url = job.result_url;
  if (TOKEN) {  // an element's src cannot carry the token: fetch it, show it from a blob: URL
    const r = await api(job.result_url);
    if (!r.ok) return;
    url = URL.createObjectURL(await r.blob());
  }
  media.setAttribute("src", url);
  link.href = url;
  card.parts.result.replaceChildren(media, link);
}

function update(card, job) {
  const key = [job.state, job.step, job.phase, job.position, job.predicted_finish, job.cancel_requested].join(":");
  if (card.dataset.key === key) return;
  card.dataset.key = key;
  card.className = "job state-" + job.state;
  card.dataset.state = job.state;
  card.parts.state.textContent = stateText(job);
  card.parts.cancel.hidden = !(job.state === "queued" || (job.state === "running" && !job.cancel_requested));
  updateProgress(card, job);
  card.parts.times.textContent = timesText(job);
  card.parts.error.textContent = job.error || "";
  if (job.result_url && !card.parts.result.firstChild) showResult(card, job);
}

function render(data) {
  $("queue-length").textContent = String(data.queue_length);
  const list = $("jobs");
  const seen = new Set();
  let running = false;
  for (const job of data.jobs) {
    seen.add(job.id);
    running = running || job.state === "running" || job.state === "queued";
    let card = cards.get(job.id);
    if (!card) { card = newCard(job); cards.set(job.id, card); }
    update(card, job);
    list.appendChild(card);  // in the API's order: running, queued, then the newest finished
  }
  for (const [id, card] of cards) { if (!seen.has(id)) { card.remove(); cards.delete(id); } }
  $("no-jobs").hidden = data.jobs.length > 0;
  return running;
}

async function refresh() {
  let busy = false;
  try {
    const r = await api("/jobs");
    if (r.ok) busy = render(await r.json());
    else if (r.status === 401) say("this server needs its token: open this page as /#token=<token>", true);
    if (r.ok && !PLAN) await loadPlan();
    if (r.ok) {
      const h = await api("/health");
      if (h.ok) {
        const hd = await h.json();
        $("status").textContent = (hd.ok ? "ready" : "shutting down") + " · " + hd.model + " on " + hd.device +
          " · queue " + hd.queue_length + " of " + hd.max_queue + (hd.paused ? " · paused" : "");
      }
    }
  } catch (e) { $("status").textContent = "the server does not answer; trying again"; }
  clearTimeout(pollTimer);
  pollTimer = setTimeout(refresh, busy ? 400 : 1500);
}

async function cancel(id) {
  const r = await api("/jobs/" + encodeURIComponent(id), {method: "DELETE"});
  if (!r.ok) { const e = await r.json().catch(() => ({error: r.statusText})); say(e.error, true); }
  refresh();
}

// -- the form -------------------------------------------------------------------------------------------------------
function readBase64(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result).split(",", 2)[1]);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function clearErrors() {
  for (const name of FIELDS) {
    const e = $("error-" + name), input = $(name);
    if (e) e.textContent = "";
    if (input) input.classList.remove("invalid");
  }
}

function fieldError(name, text) {
  const key = name === "image_base64" ? "image" : name;
  const e = $("error-" + key), input = $(key);
  if (!e) return false;
  e.textContent = text;
  if (input) input.classList.add("invalid");
  return true;
}

async function jobBody() {
  // the JSON body; the seed's digits go in as they are (a seed may exceed what a JS number holds exactly)
  const job = {prompt: $("prompt").value};
  const seed = $("seed").value.trim() || "0";
  if (!/^[0-9]{1,19}$/.test(seed)) { fieldError("seed", "a seed is a whole number from 0"); return null; }
  for (const name of ["steps", "width", "height", "frames", "guidance"]) {
    const input = $(name);
    if (!input || input.value.trim() === "") continue;
    const v = Number(input.value);
    if (!Number.isFinite(v)) { fieldError(name, "give a number"); return null; }
    job[name] = v;
  }
  const negative = $("negative_prompt");
  if (negative && negative.value.trim()) job.negative_prompt = negative.value;
  const file = $("image");
  if (file && file.files.length) {
    const max = PLAN ? PLAN.form.limits.max_body_bytes : Infinity;
    if (file.files[0].size * 4 / 3 > max) {
      fieldError("image", "this file is " + file.files[0].size.toLocaleString() + " bytes; the server takes " +
                 "jobs up to " + max.toLocaleString() + " bytes (base64 included): send a smaller image");
      return null;
    }
    job.image_base64 = await readBase64(file.files[0]);
  }
  job.seed = 0;
  return JSON.stringify(job).replace(/"seed":0(?=[,}])/, '"seed":' + seed);
}

$("submit").addEventListener("submit", async (event) => {
  event.preventDefault();
  clearErrors();
  const body = await jobBody();
  if (body === null) { say("the job was not sent: see the field marked", true); return; }
  const button = $("submit-button");
  button.disabled = true;
  try {
    const r = await api("/jobs", {method: "POST", headers: {"Content-Type": "application/json"}, body: body});
    const answer = await r.json().catch(() => ({error: r.status + " " + r.statusText}));
    if (r.ok) say("submitted job " + answer.id, false);
    else {
      const placed = (answer.fields || []).map((f) => fieldError(f, answer.error)).some((x) => x);
      say(placed ? "not queued: see the field marked" : answer.error, true);
    }
  } catch (e) { say("the server does not answer: " + e, true); }
  button.disabled = false;
  refresh();
});

for (const name of FIELDS) {
  const input = $(name);
  if (input) input.addEventListener("input", () => { input.dataset.touched = "1"; });
}
$("random-seed").addEventListener("click", () => {
  const a = new Uint32Array(1);
  crypto.getRandomValues(a);
  $("seed").value = String(a[0]);
  $("seed").dataset.touched = "1";
});
$("reset-defaults").addEventListener("click", () => { clearErrors(); setDefaults(true); });

refresh();
