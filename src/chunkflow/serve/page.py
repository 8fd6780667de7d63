"""The page at `/`: a form to submit a job and the queue, polled from the API. Self-contained (no external script,
style or font: the machine may be offline); every string from a job is put in the page as text (textContent), never
as markup. It sends JSON to its own origin only. Where the server has a token the page takes it from its URL's
fragment (`/#token=...`, removed from the address bar at once), keeps it in the tab's sessionStorage and sends it as
`Authorization: Bearer`; results are then fetched with it and shown from blob: URLs. page_policy is its
Content-Security-Policy: its own inline script and style by hash, nothing from elsewhere, no framing."""

from __future__ import annotations

import base64
import hashlib
import html
import re

__all__ = ["render_page", "page_policy"]

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>chunkflow serve__TITLE__</title>
<style>
body { font-family: system-ui, sans-serif; margin: 1.5em; max-width: 70em; color: #222; }
h1 { font-size: 1.3em; }
form { display: grid; grid-template-columns: max-content 1fr; gap: .4em .8em; max-width: 40em; }
textarea { width: 100%; min-height: 4em; }
table { border-collapse: collapse; width: 100%; margin-top: 1em; }
td, th { border-bottom: 1px solid #ddd; padding: .3em .5em; text-align: left; vertical-align: top; }
.state-failed { color: #b00; } .state-done { color: #070; } .state-cancelled { color: #777; }
video, img.result { max-width: 24em; display: block; }
#message { min-height: 1.2em; }
#message.error { color: #b00; }
</style>
</head>
<body>
<h1>chunkflow serve: <span id="model">__MODEL__</span></h1>
<form id="submit">
  <label for="prompt">Prompt</label><textarea id="prompt" name="prompt" required maxlength="4000"></textarea>
  <label for="seed">Seed</label><input id="seed" name="seed" type="number" min="0" value="0">
  <label for="steps">Steps</label><input id="steps" name="steps" type="number" min="1" placeholder="the plan's">
__IMAGE_INPUT__  <span></span><button type="submit">Submit</button>
</form>
<p id="message" role="status"></p>
<p>Queue: <span id="queue-length">?</span> waiting</p>
<table>
  <thead><tr><th>Job</th><th>State</th><th>Prompt</th><th>Seed</th><th>Predicted finish</th><th>Measured</th>
  <th>Result</th><th></th></tr></thead>
  <tbody id="jobs"></tbody>
</table>
<script>
"use strict";
const VIDEO = __VIDEO__;
const shown = new Map();  // job id -> its row, kept while the job is listed (a result element is not rebuilt)
const TOKEN = (() => {  // the server's token, if it has one: from the fragment once, then the tab's sessionStorage
  const m = /(?:^#|&)token=([^&]*)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem("chunkflow-token", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem("chunkflow-token");
})();

function api(path, options) {
  const headers = Object.assign({}, (options && options.headers) || {});
  if (TOKEN) headers["Authorization"] = "Bearer " + TOKEN;
  return fetch(path, Object.assign({cache: "no-store"}, options || {}, {headers: headers}));
}

async function showResult(media, id) {
  const path = "/jobs/" + encodeURIComponent(id) + "/result";
  if (!TOKEN) { media.setAttribute("src", path); return; }
  const r = await api(path);  // an element's src cannot carry the token: fetch it, show it from a blob: URL
  if (r.ok) media.setAttribute("src", URL.createObjectURL(await r.blob()));
}

function say(text, error) {
  const m = document.getElementById("message");
  m.textContent = text;
  m.className = error ? "error" : "";
}

function when(t) {
  return (t === null || t === undefined) ? "" : new Date(t * 1000).toLocaleTimeString();
}

function cell(row, text) {
  const td = document.createElement("td");
  td.textContent = text;
  row.appendChild(td);
  return td;
}

function render(data) {
  document.getElementById("queue-length").textContent = String(data.queue_length);
  const body = document.getElementById("jobs");
  const seen = new Set();
  for (const job of data.jobs) {
    seen.add(job.id);
    const key = job.id + ":" + job.state + ":" + job.step + ":" + job.predicted_finish;
    const old = shown.get(job.id);
    if (old && old.dataset.key === key) { body.appendChild(old); continue; }
    const row = document.createElement("tr");
    row.dataset.key = key;
    row.dataset.id = job.id;
    row.className = "job state-" + job.state;
    cell(row, job.id.slice(0, 8));
    let state = job.state;
    if (job.state === "queued" && job.position !== null) state += " (#" + (job.position + 1) + ")";
    if (job.state === "running" && job.steps_total) state += " " + job.step + "/" + job.steps_total;
    if (job.error) state += ": " + job.error;
    cell(row, state).className = "state";
    cell(row, job.prompt).className = "prompt";
    cell(row, String(job.seed));
    cell(row, job.state === "queued" || job.state === "running" ? when(job.predicted_finish) : when(job.finished));
    cell(row, job.seconds === null ? "" : job.seconds.toFixed(2) + " s");
    const result = cell(row, "");
    if (job.result_url) {
      const media = document.createElement(VIDEO ? "video" : "img");
      if (VIDEO) { media.controls = true; media.loop = true; } else { media.className = "result"; media.alt = ""; }
      showResult(media, job.id);
      result.appendChild(media);
    }
    const actions = cell(row, "");
    if (job.state === "queued" || (job.state === "running" && !job.cancel_requested)) {
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = "Cancel";
      button.addEventListener("click", () => cancel(job.id));
      actions.appendChild(button);
    }
    if (old) old.remove();
    shown.set(job.id, row);
    body.appendChild(row);
  }
  for (const [id, row] of shown) { if (!seen.has(id)) { row.remove(); shown.delete(id); } }
}

async function refresh() {
  try {
    const r = await api("/jobs");
    if (r.ok) render(await r.json());
    else if (r.status === 401) say("this server needs its token: open this page as /#token=<token>", true);
    const model = document.getElementById("model");
    if (r.ok && !model.textContent) {
      const h = await api("/health");
      if (h.ok) { model.textContent = (await h.json()).model; document.title += ": " + model.textContent; }
    }
  } catch (e) { /* the server is away: try again at the next poll */ }
}

async function cancel(id) {
  const r = await api("/jobs/" + encodeURIComponent(id), {method: "DELETE"});
  if (!r.ok) { const e = await r.json().catch(() => ({error: r.statusText})); say(e.error, true); }
  refresh();
}

function readBase64(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result).split(",", 2)[1]);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

document.getElementById("submit").addEventListener("submit", async (event) => {
  event.preventDefault();
  const job = {prompt: document.getElementById("prompt").value,
               seed: Number(document.getElementById("seed").value || 0)};
  const steps = document.getElementById("steps").value;
  if (steps) job.steps = Number(steps);
  const file = document.getElementById("image");
  if (file && file.files.length) job.image_base64 = await readBase64(file.files[0]);
  const r = await api("/jobs", {method: "POST", headers: {"Content-Type": "application/json"},
                                body: JSON.stringify(job)});
  const answer = await r.json().catch(() => ({error: r.statusText}));
  if (r.ok) say("submitted " + answer.id.slice(0, 8), false); else say(answer.error, true);
  refresh();
});

refresh();
setInterval(refresh, 1000);
</script>
</body>
</html>
"""

_IMAGE_INPUT = ('  <label for="image">Image</label><input id="image" name="image" type="file" required '
                'accept="image/png,image/jpeg,image/webp">\n')


def render_page(model: str | None, *, image: bool, video: bool) -> str:
    """The page for a server of `model` (its name escaped; None: the page asks /health for it); an image input
    where the pipeline takes one."""
    name = html.escape(model) if model else ""
    return (_PAGE.replace("__TITLE__", f": {name}" if name else "").replace("__MODEL__", name)
            .replace("__IMAGE_INPUT__", _IMAGE_INPUT if image else "")
            .replace("__VIDEO__", "true" if video else "false"))


def _hashes(tag: str, text: str) -> str:
    return " ".join("'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"
                    for body in re.findall(rf"<{tag}>(.*?)</{tag}>", text, re.S))


def page_policy(text: str) -> str:
    """The Content-Security-Policy for the rendered page `text`: its inline script and style only (by their
    hashes), requests to its own origin, results shown from it or from blob: URLs, no framing, no form target."""
    return (f"default-src 'none'; script-src {_hashes('script', text)}; style-src {_hashes('style', text)}; "
            "connect-src 'self'; img-src 'self' blob:; media-src 'self' blob:; base-uri 'none'; "
            "form-action 'none'; frame-ancestors 'none'")
