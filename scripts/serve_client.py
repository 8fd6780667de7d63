"""A client of `chunkflow serve` for the GPU evidence (docs/data/h200-many/gpu_h200_many.sh): waits for the server,
submits every job of a prompt file at once, keeps what the server predicted at submission (each job's start and
finish), polls until every job is over, samples the server's host memory (VmRSS of --pid) as each job finishes,
fetches the results, and writes what it saw as JSON; prints a table of predicted against measured finish times.

    python scripts/serve_client.py http://127.0.0.1:8765 jobs.jsonl --pid PID --fetch DIR --out client.json
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from pathlib import Path


def call(url: str, method: str = "GET", body: dict | None = None, timeout: float = 30.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
        return r.status, (json.loads(raw) if r.headers.get("content-type", "").startswith("application/json")
                          else raw)


def rss(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("jobs")
    ap.add_argument("--pid", type=int)
    ap.add_argument("--fetch", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--wait", type=float, default=400.0, help="seconds to wait for the server to load")
    a = ap.parse_args()
    t_start = time.time()
    while True:
        try:
            _, health = call(a.url + "/health", timeout=5)
            break
        except (urllib.error.URLError, ConnectionError, OSError):
            if time.time() - t_start > a.wait:
                raise SystemExit("the server did not come up")
            time.sleep(0.5)
    t_ready = time.time()
    print(f"server up after {t_ready - t_start:.1f} s: {health}", flush=True)
    jobs = [json.loads(line) for line in Path(a.jobs).read_text().splitlines() if line.strip()]
    sent = []
    for job in jobs:
        status, snap = call(a.url + "/jobs", "POST", job)
        assert status == 201, (status, snap)
        sent.append({"seed": job["seed"], "prompt": job["prompt"], "id": snap["id"], "submitted": snap["submitted"],
                     "predicted_start_at_submit": snap["predicted_start"],
                     "predicted_finish_at_submit": snap["predicted_finish"], "predicted_s_at_submit": snap["predicted_s"]})
    print(f"{len(sent)} jobs submitted", flush=True)
    over: dict[str, dict] = {}
    while len(over) < len(sent):
        _, listing = call(a.url + "/jobs")
        by_id = {j["id"]: j for j in listing["jobs"]}
        if over and "predicted_finish_after_first" not in sent[-1]:  # what it says once a job is done
            for s in sent:
                j = by_id.get(s["id"])
                s["predicted_finish_after_first"] = j["predicted_finish"] if j and j["state"] in ("queued", "running") \
                    else None
        for s in sent:
            j = by_id.get(s["id"])
            if j and j["state"] in ("done", "failed", "cancelled") and s["id"] not in over:
                over[s["id"]] = j
                s["rss_after_bytes"] = rss(a.pid)
                print(f"seed {s['seed']}: {j['state']} in {j['seconds']:.2f} s (predicted {j['predicted_s']})",
                      flush=True)
        time.sleep(0.2)
    fetch = Path(a.fetch)
    fetch.mkdir(parents=True, exist_ok=True)
    for s in sent:
        j = over[s["id"]]
        s.update(state=j["state"], started=j["started"], finished=j["finished"], seconds=j["seconds"],
                 predicted_s=j["predicted_s"], error=j["error"])
        if j["state"] == "done":
            _, data = call(a.url + j["result_url"], timeout=60)
            (fetch / f"{s['id']}.mp4").write_bytes(data)
    _, metrics = call(a.url + "/metrics")
    t0 = sent[0]["submitted"]
    nan = float("nan")
    print("finish times from the first submission; predicted at submission, and once the first job was done")
    print(f"{'seed':>4} {'measured s':>10} {'predicted s':>11} {'finish':>8} {'at submit':>9} {'error':>7} "
          f"{'after 1st':>9} {'error':>7}")
    for s in sent:
        row = f"{s['seed']:>4} {s['seconds'] or 0:>10.2f} {s['predicted_s'] or 0:>11.2f} {s['finished'] - t0:>8.2f}"
        for key in ("predicted_finish_at_submit", "predicted_finish_after_first"):
            pf = s.get(key)
            row += f" {(pf - t0) if pf else nan:>9.2f} {(s['finished'] - pf) / (pf - t0) if pf else nan:>+7.1%}"
        print(row)
    Path(a.out).write_text(json.dumps({"url": a.url, "ready_after_s": t_ready - t_start, "health": health,
                                       "jobs": sent, "metrics": metrics.decode() if isinstance(metrics, bytes)
                                       else metrics}, indent=2) + "\n")


if __name__ == "__main__":
    main()
