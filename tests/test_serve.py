"""`chunkflow serve`: the tiny Wan pipeline saved with save_pretrained, loaded once, behind a real uvicorn server on
127.0.0.1, driven over HTTP by urllib: jobs submitted, polled, fetched (a readable mp4 whose frames are those a
separate session makes with the same seed), cancelled (queued and running), refused with the right status and
message; health, metrics and the page; a clean shutdown. The worker is held (JobQueue.pause) or a step blocked (the
queue's observer) where a test needs a job to wait: nothing depends on timing."""

from __future__ import annotations

import base64
import http.client
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from pipelines import one_thread

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("imageio_ffmpeg")

BODY_LIMIT = 256 * 1024  # the test server's request body limit (the default is 32 MB)
WAIT_S = 120  # the longest any wait may take before the test fails (not a timing assertion: a hang guard)


class Server:
    """A JobQueue over a loaded session, its app served by uvicorn in a background thread on a free port."""

    def __init__(self, plan: Path, weights: Path, out_dir: Path, max_queue: int = 4) -> None:
        import chunkflow
        from chunkflow.serve.app import make_app
        from chunkflow.serve.queue import JobQueue

        self.gate = threading.Event()  # set: steps run freely; cleared: a step waits (see hold_step)
        self.gate.set()
        self.at_step = threading.Event()
        self.session = chunkflow.load(plan, weights=weights, device="cpu")
        self.queue = JobQueue(self.session, out_dir, max_queue=max_queue, observer=self._observe)
        self.app = make_app(self.queue, max_body_bytes=BODY_LIMIT)
        self.port, self.server, self.thread = serve_app(self.app)
        self.url = f"http://127.0.0.1:{self.port}"

    def _observe(self, job_id: str, i: int, n: int) -> None:
        self.at_step.set()
        assert self.gate.wait(WAIT_S)

    def stop(self) -> None:
        self.gate.set()
        self.server.should_exit = True
        self.thread.join(WAIT_S)
        self.queue.shutdown(WAIT_S)


def serve_app(app):
    """(port, uvicorn server, its thread): `app` served on a free port of 127.0.0.1 once it accepts connections."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive())
    assert server.started
    return sock.getsockname()[1], server, thread


def wait_until(check, what: str = "the condition") -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {WAIT_S} s")
        time.sleep(0.02)


def call(server: Server, method: str, path: str, body=None, raw: bytes | None = None,
         headers: dict | None = None) -> tuple[int, dict | bytes, dict]:
    """(status, JSON or bytes, headers) of one request; error statuses returned, not raised."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(server.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=WAIT_S) as r:
            status, content, h = r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        status, content, h = e.code, e.read(), dict(e.headers)
    if h.get("content-type", "").startswith("application/json"):
        return status, json.loads(content), h
    return status, content, h


def finished(server: Server, job_id: str) -> dict:
    """The job once it has finished (polled)."""
    snaps = []

    def over() -> bool:
        snaps.append(call(server, "GET", f"/jobs/{job_id}")[1])
        return snaps[-1]["state"] in ("done", "failed", "cancelled")

    wait_until(over, f"job {job_id} finishing")
    return snaps[-1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny Wan pipeline saved with save_pretrained, and a CPU plan for it."""
    from typer.testing import CliRunner

    from chunkflow.commands.cli import app
    from pipelines import save_catalog_pipeline

    root = tmp_path_factory.mktemp("serve")
    with one_thread():
        folder = save_catalog_pipeline("tiny", root / "tiny", 3)
    plan = root / "plan.json"
    result = CliRunner().invoke(app, ["plan", "--model", "tiny", "--hardware", "cpu", "--host-mem-budget", "8GB",
                                      "--out", str(plan)], env={"CHUNKFLOW_CONFIG_DIR": str(root / "config")})
    assert result.exit_code == 0, result.output
    return root, plan, folder


@pytest.fixture(scope="module")
def server(setup):
    root, plan, folder = setup
    with one_thread():
        s = Server(plan, folder, root / "outputs")
        try:
            yield s
        finally:
            s.stop()


def test_jobs_run_in_order_and_give_the_frames_a_separate_session_gives(server, setup):
    import chunkflow
    from chunkflow.media import read_video

    root, plan, folder = setup
    jobs = [{"prompt": "a cat walks on the grass", "seed": s, "steps": 2} for s in (1, 2)]
    jobs.append({"prompt": "a red fox in the snow", "seed": 3, "steps": 3})
    server.queue.pause()  # all three queued before the worker takes one: their positions are known
    ids = []
    for i, job in enumerate(jobs):
        status, snap, headers = call(server, "POST", "/jobs", job)
        assert status == 201, snap
        assert snap["state"] == "queued" and snap["position"] == i and snap["prompt"] == job["prompt"]
        assert len(snap["id"]) == 32 and headers["location"] == f"/jobs/{snap['id']}"
        assert snap["predicted_start"] is None and snap["predicted_finish"] is None  # the CPU: not predicted
        ids.append(snap["id"])
    status, listing, _ = call(server, "GET", "/jobs")
    assert [j["id"] for j in listing["jobs"][:3]] == ids and listing["queue_length"] == 3 and listing["paused"]
    server.queue.resume()
    snaps = [finished(server, i) for i in ids]
    assert [s["state"] for s in snaps] == ["done"] * 3, snaps
    assert snaps[0]["finished"] <= snaps[1]["started"] and snaps[1]["finished"] <= snaps[2]["started"]
    for snap in snaps:
        assert snap["seconds"] > 0 and snap["output"] == snap["id"] + ".mp4"
        assert snap["result_url"] == f"/jobs/{snap['id']}/result"
        assert snap["step"] == snap["steps_total"] == snap["steps"], [(s["step"], s["steps_total"], s["steps"]) for s in snaps]
        assert snap["progress"] == 1.0 and snap["phase"] is None
    for job, snap in zip(jobs, snaps):  # what each ran with: the plan's defaults filled in, the seed as text
        assert snap["settings"] == {"seed": str(job["seed"]), "steps": job["steps"], "width": 64, "height": 64,
                                    "frames": 5, "guidance": server.session.spec.pipeline.guidance,
                                    "negative_prompt": None, "cache": None}

    reference = root / "reference"
    reference.mkdir()
    with chunkflow.load(plan, weights=folder, device="cpu") as other:
        for job, snap in zip(jobs, snaps):
            status, content, headers = call(server, "GET", snap["result_url"])
            assert status == 200 and headers["content-type"] == "video/mp4"
            got = reference / f"served-{snap['id']}.mp4"
            got.write_bytes(content)
            frames = read_video(got)
            assert frames.shape[0] == other.plan.workload.frames
            want = other.generate(job["prompt"], seed=job["seed"], steps=job["steps"])
            assert want.output.shape[0] == frames.shape[0]
            want_frames = read_video(want.save(reference / f"fresh-{snap['id']}.mp4"))
            np.testing.assert_array_equal(frames, want_frames)
    # the outputs are named by the job's id only, in the server's folder
    assert {p.name for p in (root / "outputs").iterdir()} >= {s["output"] for s in snaps}


def test_a_queued_job_is_cancelled_and_never_runs(server):
    server.queue.pause()
    try:
        ids = [call(server, "POST", "/jobs", {"prompt": f"job {i}", "seed": i, "steps": 1})[1]["id"]
               for i in range(3)]
        status, snap, _ = call(server, "DELETE", f"/jobs/{ids[-1]}")
        assert status == 200 and snap["state"] == "cancelled" and snap["started"] is None
        status, listing, _ = call(server, "GET", "/jobs")
        queued = [j["id"] for j in listing["jobs"] if j["state"] == "queued"]
        assert queued == ids[:2]
    finally:
        server.queue.resume()
    assert [finished(server, i)["state"] for i in ids] == ["done", "done", "cancelled"]
    status, err, _ = call(server, "GET", f"/jobs/{ids[-1]}/result")
    assert status == 409 and "cancelled" in err["error"]
    status, err, _ = call(server, "DELETE", f"/jobs/{ids[0]}")
    assert status == 409 and "finished" in err["error"]


def test_a_running_job_stops_at_its_next_step_when_cancelled(server):
    server.gate.clear()
    server.at_step.clear()
    try:
        status, snap, _ = call(server, "POST", "/jobs", {"prompt": "a long one", "seed": 5, "steps": 4})
        assert status == 201
        wait_until(server.at_step.is_set, "the job's first step")  # the worker waits inside step 1
        running = call(server, "GET", f"/jobs/{snap['id']}")[1]
        assert running["state"] == "running" and running["phase"] == "denoise"
        assert (running["step"], running["steps_total"], running["progress"]) == (1, 4, 0.25)
        status, after, _ = call(server, "DELETE", f"/jobs/{snap['id']}")
        assert status == 200 and after["state"] == "running" and after["cancel_requested"]
    finally:
        server.gate.set()
    done = finished(server, snap["id"])
    assert done["state"] == "cancelled" and done["step"] == 1 and done["output"] is None
    # the session goes on: the next job runs
    status, snap, _ = call(server, "POST", "/jobs", {"prompt": "after the cancel", "seed": 6, "steps": 1})
    assert finished(server, snap["id"])["state"] == "done"


def test_a_job_that_does_not_fit_is_refused_with_the_planners_reason(server):
    status, err, _ = call(server, "POST", "/jobs", {"prompt": "too large", "height": 8192, "width": 8192})
    assert status == 422
    assert "host memory" in err["error"] or "memory" in err["error"], err
    assert "smaller size" in err["error"] and "chunkflow plan --height 8192 --width 8192" in err["error"]


@pytest.mark.parametrize("job, fields, words", [
    ({"width": 50}, ["width"], "divisible by 16"),
    ({"frames": 6}, ["frames"], "frames = 1 mod 4"),
    ({"steps": "3"}, ["steps"], "steps"),
    ({"seed": -1, "guidance": 0}, ["seed", "guidance"], "seed"),
    ({"height": 8192, "width": 8192}, ["height", "width", "frames"], "smaller size"),
])
def test_a_refusal_names_the_fields_it_is_about(server, job, fields, words):
    got, err, _ = call(server, "POST", "/jobs", {"prompt": "x", **job})
    assert got == 422 and err["fields"] == fields and words in err["error"], err


def test_error_fields_reads_the_field_a_message_is_about():
    from chunkflow.serve.app import error_fields

    assert error_fields("image_base64 is not valid base64; give the image file's bytes base64-encoded") == [
        "image_base64"]
    assert error_fields("tiny's pipeline takes no negative prompt (its guidance is embedded: guidance sets it); "
                        "leave negative_prompt out") == ["negative_prompt"]
    assert error_fields("prompt: Field required") == ["prompt"]
    assert error_fields("a job is a JSON object with at least \"prompt\", not list") == []


def test_the_plan_route_says_what_the_page_shows(server, setup):
    from chunkflow_planner.units import format_bytes, format_seconds

    plan = json.loads(setup[1].read_text())
    status, view, _ = call(server, "GET", "/plan")
    assert status == 200 and view["model"] == "tiny-wan" and view["device"] == "cpu"
    w = plan["workload"]
    assert view["form"]["defaults"] == {"seed": 0, "steps": w["steps"], "width": w["width"], "height": w["height"],
                                        "frames": w["frames"], "guidance": server.session.spec.pipeline.guidance}
    assert view["form"]["video"] and view["form"]["negative_prompt"] and not view["form"]["image"]
    assert view["form"]["limits"]["width_step"] == 16 and view["form"]["limits"]["frames_step"] == 4
    assert view["form"]["limits"]["max_body_bytes"] == BODY_LIMIT
    # a CPU plan's times are nominal: the queue predicts nothing and says why
    assert not view["predicts"] and view["nominal"] and view["prediction_note"].startswith("No prediction")
    comps = plan["pipeline"]["components"]
    assert [(c["name"], c["placement"], c["bytes"]) for c in view["components"]] == [
        (c["name"], c["placement"], c["bytes"]) for c in comps]
    by_name = {c["name"]: c for c in view["components"]}
    assert by_name["text_encoder"]["runs_on"] == "CPU" and by_name["text_encoder"]["held_in"] == "host memory"
    assert by_name["transformer"]["runs_on"] == "device (the CPU)"
    assert by_name["vae"]["runs_on"].endswith("tiled decode") == plan["pipeline"]["vae_tiling"]
    assert by_name["text_encoder"]["host_bytes"] == plan["prediction"]["host_memory"]["text_encoder"]
    pp, got = plan["prediction"], view["prediction"]
    assert got["step_time"] == {"s": pp["step_time_s"], "text": format_seconds(pp["step_time_s"])}
    assert got["generation_time"]["s"] == pp["generation_time_s"]
    assert [(p["name"], p["time"]["s"], p["peak_memory"]["text"]) for p in got["phases"]] == [
        (n, pp["phases"][n]["time_s"], format_bytes(pp["phases"][n]["peak_memory_bytes"]))
        for n in ("encode", "denoise", "decode")]
    assert got["host_budget"]["bytes"] == plan["host_memory_budget_bytes"]


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not valid JSON"),
    (b"\xff\xfe", 400, "not valid JSON"),
    (json.dumps({"prompt": "x", "colour": "red"}).encode(), 422, "colour"),
    (json.dumps({"seed": 1}).encode(), 422, "prompt"),
    (json.dumps(["a", "list"]).encode(), 422, "JSON object"),
    (json.dumps({"prompt": "x", "steps": 0}).encode(), 422, "steps"),
    (json.dumps({"prompt": "x", "image": "/etc/passwd"}).encode(), 422, "image_base64"),
    (json.dumps({"prompt": "x", "out": "../../x.mp4"}).encode(), 422, "job id"),
    (json.dumps({"prompt": "x", "image_base64": "not base64!"}).encode(), 422, "base64"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),  # a RecursionError in json, not a 500
    (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", 400, "not valid JSON for a job"),  # past int()'s digits
    (json.dumps({"prompt": "x", "steps": True}).encode(), 422, "steps"),  # JSON as given: no coercion
    (json.dumps({"prompt": "x", "seed": "5"}).encode(), 422, "seed"),
])
def test_bad_requests_are_refused_with_what_was_wrong(server, body, status, words):
    got, err, _ = call(server, "POST", "/jobs", raw=body)
    assert got == status and words in err["error"], err


def test_an_image_for_a_pipeline_that_takes_none_is_refused(server):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (255, 0, 0)).save(buf, "PNG")
    got, err, _ = call(server, "POST", "/jobs", {"prompt": "x", "image_base64": base64.b64encode(buf.getvalue())
                                                 .decode()})
    assert got == 422 and "takes no image" in err["error"], err
    got, err, _ = call(server, "POST", "/jobs", {"prompt": "x", "image_base64": base64.b64encode(b"GIF89a junk")
                                                 .decode()})
    assert got == 422 and "image_base64" in err["error"], err


def test_an_oversized_body_is_refused_before_it_is_read(server):
    big = json.dumps({"prompt": "x", "image_base64": "A" * (BODY_LIMIT + 10)}).encode()
    status, err, _ = call(server, "POST", "/jobs", raw=big)
    assert status == 413 and "over" in err["error"]
    # without a Content-Length (chunked): the cap holds while the body is streamed
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
    try:
        conn.request("POST", "/jobs", body=iter([big[i:i + 8192] for i in range(0, len(big), 8192)]),
                     headers={"Content-Type": "application/json"}, encode_chunked=True)
        r = conn.getresponse()
        assert r.status == 413 and "over" in json.loads(r.read())["error"]
    finally:
        conn.close()


def test_a_full_queue_refuses_with_429(server):
    server.queue.pause()
    ids = []
    try:
        for i in range(server.queue.max_queue):
            status, snap, _ = call(server, "POST", "/jobs", {"prompt": f"fill {i}", "steps": 1})
            assert status == 201
            ids.append(snap["id"])
        status, err, _ = call(server, "POST", "/jobs", {"prompt": "one too many", "steps": 1})
        assert status == 429 and "at most 4" in err["error"]
    finally:
        for i in ids:
            call(server, "DELETE", f"/jobs/{i}")
        server.queue.resume()


@pytest.mark.parametrize("path, status", [
    ("/jobs/" + "0" * 32, 404), ("/jobs/" + "0" * 32 + "/result", 404), ("/jobs/xyz", 400),
    ("/jobs/..%2F..%2Fplan.json", 404), ("/jobs/%2E%2E", 400), ("/jobs/ABCDEF" + "0" * 26, 400),
    ("/jobs/..%2Fplan.json/result", 404), ("/nowhere", 404),
])
def test_unknown_and_path_like_ids_are_refused(server, path, status):
    got, err, _ = call(server, "GET", path)
    assert got == status and isinstance(err, dict) and err["error"], err
    if path.startswith("/jobs/") and path.count("/") == 2:
        got, err, _ = call(server, "DELETE", path)
        assert got in (400, 404, 405) and err["error"]


def test_health_and_metrics(server):
    status, health, _ = call(server, "GET", "/health")
    assert status == 200 and health["ok"] and health["model"] == server.session.spec.name == "tiny-wan" and health["device"] == "cpu"
    assert health["queue_length"] == 0 and health["video"] and not health["image"] and health["cache"] is None
    status, text, headers = call(server, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for line in text.decode().splitlines():
        if line.startswith("#"):
            assert line.split()[1] in ("HELP", "TYPE")
            continue
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    assert samples["chunkflow_queue_length"] == 0
    assert set(k for k in samples if k.startswith("chunkflow_jobs{")) == {
        f'chunkflow_jobs{{state="{s}"}}' for s in ("queued", "running", "done", "failed", "cancelled")}
    assert samples['chunkflow_jobs_finished_total{state="done"}'] >= 1  # the module's earlier jobs
    assert samples["chunkflow_last_generation_seconds"] > 0
    assert np.isnan(samples["chunkflow_last_generation_predicted_seconds"])  # the CPU: not predicted
    assert samples['chunkflow_generation_time_ratio_bucket{le="+Inf"}'] == samples[
        "chunkflow_generation_time_ratio_count"]


def test_the_page_has_the_form_and_no_external_assets(server):
    status, page, headers = call(server, "GET", "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    page = page.decode()
    assert '<form id="submit"' in page and 'id="prompt"' in page and 'id="seed"' in page and 'id="steps"' in page
    assert 'type="file"' not in page  # the tiny Wan pipeline takes no image
    # the fields the tiny Wan pipeline takes: a video model (frames) with true guidance (a negative prompt)
    assert 'id="frames"' in page and 'id="negative_prompt"' in page and 'id="guidance"' in page
    assert 'id="width"' in page and 'id="height"' in page and 'id="plan"' in page
    assert "innerHTML" not in page and "http://" not in page and "https://" not in page and "<link" not in page


CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_a_browser_renders_the_queue_from_the_api(server, tmp_path):
    server.queue.pause()
    try:
        prompt = "<b>a fox</b> & <script>alert(1)</script>"
        status, snap, _ = call(server, "POST", "/jobs", {"prompt": prompt, "seed": 7, "steps": 1})
        assert status == 201
        run = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                              f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000",
                              server.url + "/"], capture_output=True, text=True, timeout=WAIT_S)
        dom = run.stdout
        assert "<tbody" in dom, run.stderr[-2000:]
        assert f'data-id="{snap["id"]}"' in dom and "queued (#1)" in dom
        # the prompt shown as text: its markup escaped in the DOM, never elements
        assert "&lt;b&gt;a fox&lt;/b&gt; &amp; &lt;script&gt;alert(1)&lt;/script&gt;" in dom
        assert "<b>a fox</b>" not in dom
    finally:
        call(server, "DELETE", f"/jobs/{snap['id']}")
        server.queue.resume()


def test_a_failing_generation_marks_its_job_failed_and_the_worker_goes_on(server, monkeypatch):
    from chunkflow.generate import GenerationError

    real = server.session.generate
    calls = []

    def broken(job, **kw):
        calls.append(job.prompt)
        if job.prompt == "nan please":
            raise GenerationError("the latents hold NaN or infinite values after denoising step 1 of 1")
        if job.prompt == "crash please":
            raise RuntimeError("something broke")
        return real(job, **kw)

    monkeypatch.setattr(server.session, "generate", broken)
    server.queue.pause()
    ids = [call(server, "POST", "/jobs", {"prompt": p, "steps": 1})[1]["id"]
           for p in ("nan please", "crash please", "fine")]
    server.queue.resume()
    snaps = [finished(server, i) for i in ids]
    assert [s["state"] for s in snaps] == ["failed", "failed", "done"]
    assert "NaN" in snaps[0]["error"] and snaps[1]["error"] == "RuntimeError: something broke"
    assert snaps[2]["error"] is None and calls == ["nan please", "crash please", "fine"]


def test_shutdown_cancels_waiting_jobs_ends_the_worker_and_closes_the_session(setup, tmp_path):
    root, plan, folder = setup
    with one_thread():
        s = Server(plan, folder, tmp_path / "outputs")
        s.queue.pause()
        status, snap, _ = call(s, "POST", "/jobs", {"prompt": "never run", "steps": 1})
        assert status == 201
        s.stop()
    assert not s.thread.is_alive() and not s.queue._worker.is_alive()
    assert s.session.closed and s.queue.closed
    assert s.queue.get(snap["id"])["state"] == "cancelled"
    from chunkflow.serve.queue import QueueClosed
    from chunkflow_planner.pipeline.jobs import Job

    with pytest.raises(QueueClosed):
        s.queue.submit(Job(prompt="too late"))
    s.queue.shutdown()  # a second shutdown does nothing


# -- the command ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, words", [
    (["--port", "0"], "--port must be between 1 and 65535"),
    (["--port", "70000"], "--port must be between 1 and 65535"),
    (["--max-queue", "0"], "--max-queue must be between 1"),
    (["--log-level", "loud"], "--log-level must be one of"),
    (["--out-dir", "plan.json"], "is a file; give a directory"),
])
def test_serve_checks_its_options_before_loading(cli, setup, workdir, args, words):
    root, plan, folder = setup
    shutil.copy(plan, workdir / "plan.json")
    result = cli("serve", "--plan", "plan.json", *args)
    assert result.exit_code == 2 and words in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output


def test_serve_refuses_a_missing_plan_and_a_port_in_use(cli, setup, workdir):
    root, plan, folder = setup
    result = cli("serve", "--plan", "nowhere.json")
    assert result.exit_code == 2 and "nowhere.json" in result.output
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        result = cli("serve", "--plan", plan, "--weights", folder, "--port", taken.getsockname()[1])
    finally:
        taken.close()
    assert result.exit_code == 2 and "port is in use" in result.output, result.output


def test_serve_without_fastapi_says_what_to_install(cli, setup, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    result = cli("serve", "--plan", setup[1])
    assert result.exit_code == 2 and "pip install 'chunkflow-dit[serve]'" in result.output, result.output


def test_loopback_addresses():
    from chunkflow.serve.server import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2") and not is_loopback("example.org")


@pytest.mark.slow
def test_chunkflow_serve_serves_and_stops_cleanly_on_ctrl_c(setup, tmp_path):
    import os
    import signal
    import sys

    from conftest import SRC

    root, plan, folder = setup
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    token = "a-token-for-this-test-0123456789"
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1", CHUNKFLOW_CONFIG_DIR=str(tmp_path / "config"),
               CHUNKFLOW_SERVE_TOKEN=token)
    proc = subprocess.Popen([sys.executable, "-m", "chunkflow", "serve", "--plan", str(plan), "--weights",
                             str(folder), "--device", "cpu", "--port", str(port), "--out-dir",
                             str(tmp_path / "out"), "--log-level", "info"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # the URL, once the server accepts connections
        assert f"http://127.0.0.1:{port}/" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        s = type("S", (), {"url": f"http://127.0.0.1:{port}"})()
        status, err, _ = call(s, "POST", "/jobs", {"prompt": "no token", "seed": 1, "steps": 1})
        assert status == 401 and "Authorization: Bearer" in err["error"]
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as c:  # a client gone mid-body
            c.sendall(f"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
                      "Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n{\"prompt\"".encode())
        auth = {"Authorization": f"Bearer {token}"}
        status, snap, _ = call(s, "POST", "/jobs", {"prompt": "a cat", "seed": 1, "steps": 1}, headers=auth)
        assert status == 201
        over = lambda: call(s, "GET", f"/jobs/{snap['id']}", headers=auth)[1]["state"] == "done"  # noqa: E731
        wait_until(over, "the job")
        assert (tmp_path / "out" / f"{snap['id']}.mp4").is_file()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "stopping (Ctrl-C)" in err and "stopped: 1 job done, 0 failed, 0 cancelled" in err
    assert "Traceback" not in err and "every request needs the token" in err and token not in err + out, err
    (gone,) = [line for line in err.splitlines() if "went away" in line]  # the dropped client: one line
    assert "nothing queued" in gone and "Exception" not in err, err


def test_predicted_times_chain_the_jobs_with_the_measured_output_time():
    """Each queued job starts when the one before is predicted to be over, its output written (the seconds the
    jobs done spent beyond their generation); an overrunning job ends 'now' at best; a paused queue or a job the
    plan does not predict ends the chain."""
    from chunkflow.serve.queue import chain_times

    assert chain_times(100.0, (90.0, 8.0), [7.0, 7.0], 0.5) == [(100.0, 107.5), (107.5, 115.0)]
    assert chain_times(100.0, (80.0, 8.0), [7.0], 0.5) == [(100.0, 107.5)]  # the running job overran
    assert chain_times(100.0, None, [8.0, 7.0], 0.0) == [(100.0, 108.0), (108.0, 115.0)]
    assert chain_times(None, None, [8.0], 0.5) == [(None, None)]  # paused
    assert chain_times(100.0, None, [8.0, None, 7.0], 0.5) == [(100.0, 108.5), (None, None), (None, None)]
    assert chain_times(100.0, (90.0, None), [7.0], 0.5) == [(None, None)]


# -- who may use the server (issue 51): a web page, a rebound name, another origin, a missing token -------------
JOB = json.dumps({"prompt": "a page's job", "steps": 1}).encode()


def raw(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, JSON or bytes, headers) of one request sent with exactly `headers` (Host included: none is added)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        content, h = r.read(), {k.lower(): v for k, v in r.getheaders()}
        return r.status, json.loads(content) if h.get("content-type", "").startswith("application/json") else content, h
    finally:
        conn.close()


def own(server) -> dict:
    return {"Host": f"127.0.0.1:{server.port}"}


@pytest.fixture
def nothing_queued(server):
    """The queue held; afterwards: no job was accepted in the test (the submitted count is where it was)."""
    server.queue.pause()
    before = server.queue.stats.submitted
    try:
        yield
        assert server.queue.stats.submitted == before and len(server.queue) == 0
    finally:
        server.queue.resume()


@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                          None, "application/json; charset=latin-1", "application/jsonp"])
def test_a_job_not_sent_as_json_is_refused_and_nothing_queued(server, nothing_queued, content_type):
    headers = own(server) | ({"Content-Type": content_type} if content_type else {})
    status, err, _ = raw(server.port, "POST", "/jobs", JOB, headers)
    assert status == 415 and "Content-Type: application/json" in err["error"], err


def test_json_with_a_charset_is_a_job(server):
    server.queue.pause()
    try:
        status, snap, _ = raw(server.port, "POST", "/jobs", JOB,
                              own(server) | {"Content-Type": "Application/JSON; charset=utf-8"})
        assert status == 201, snap
        assert server.queue.get(snap["id"])["state"] == "queued"
    finally:
        call(server, "DELETE", f"/jobs/{snap['id']}")
        server.queue.resume()


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:1", "https://127.0.0.1:{port}",
                                    "http://localhost:{port}"])
@pytest.mark.parametrize("content_type", ["application/json", "text/plain"])
def test_another_origin_cannot_submit(server, nothing_queued, origin, content_type):
    headers = own(server) | {"Origin": origin.format(port=server.port), "Content-Type": content_type}
    status, err, _ = raw(server.port, "POST", "/jobs", JOB, headers)
    assert status == 403 and "Origin" in err["error"], err


def test_another_origin_cannot_cancel_or_read_and_the_own_origin_can(server):
    server.queue.pause()
    try:
        mine = own(server) | {"Origin": f"http://127.0.0.1:{server.port}", "Content-Type": "application/json"}
        status, snap, headers = raw(server.port, "POST", "/jobs", JOB, mine)
        assert status == 201 and "access-control-allow-origin" not in headers
        foreign = own(server) | {"Origin": "http://evil.example"}
        assert raw(server.port, "DELETE", f"/jobs/{snap['id']}", headers=foreign)[0] == 403
        assert raw(server.port, "GET", "/jobs", headers=foreign)[0] == 403
        # a preflight is answered with no CORS permission (and the route does not exist for OPTIONS)
        status, _, headers = raw(server.port, "OPTIONS", "/jobs", headers=foreign | {
            "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
        assert status >= 400 and not any(k.startswith("access-control-") for k in headers)
        # no Origin at all (curl, a script): allowed
        assert server.queue.get(snap["id"])["state"] == "queued"
        status, after, _ = raw(server.port, "DELETE", f"/jobs/{snap['id']}", headers=own(server))
        assert status == 200 and after["state"] == "cancelled"
    finally:
        server.queue.resume()


def test_another_sites_fetch_or_embed_is_refused_and_a_link_to_the_page_works(server, nothing_queued):
    embed = own(server) | {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Dest": "video"}
    status, err, _ = raw(server.port, "GET", "/jobs/" + "0" * 32 + "/result", headers=embed)
    assert status == 403 and "cross-site" in err["error"]
    post = own(server) | {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "no-cors", "Content-Type": "text/plain"}
    assert raw(server.port, "POST", "/jobs", JOB, post)[0] == 403
    link = own(server) | {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}
    status, page, headers = raw(server.port, "GET", "/", headers=link)
    assert status == 200 and b'<form id="submit"' in page
    assert "frame-ancestors 'none'" in headers["content-security-policy"] and headers["x-frame-options"] == "DENY"
    assert headers["cross-origin-resource-policy"] == "same-origin"
    framed = link | {"Sec-Fetch-Dest": "iframe"}
    assert raw(server.port, "GET", "/", headers=framed)[0] == 403


def test_the_pages_policy_allows_its_own_script_and_style_only(server):
    import hashlib
    import re

    status, page, headers = raw(server.port, "GET", "/", headers=own(server))
    policy = headers["content-security-policy"]
    for tag in ("script", "style"):
        (body,) = re.findall(rf"<{tag}>(.*?)</{tag}>".encode(), page, re.S)
        digest = base64.b64encode(hashlib.sha256(body).digest()).decode()
        assert f"{tag}-src 'sha256-{digest}'" in policy
    assert "default-src 'none'" in policy and "unsafe" not in policy


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1", "127.0.0.1:1",
                                  "localhost.:{port}", "127.0.0.2:{port}", "0.0.0.0:{port}", "[::1]:1",
                                  "127.0.0.1:{port}@evil", ""])
def test_a_foreign_host_is_refused_on_every_route(server, nothing_queued, host):
    headers = {"Host": host.format(port=server.port)}
    for method, path in [("GET", "/"), ("GET", "/jobs"), ("GET", "/health"), ("GET", "/metrics"),
                         ("GET", "/jobs/" + "0" * 32 + "/result"), ("DELETE", "/jobs/" + "0" * 32)]:
        status, err, _ = raw(server.port, method, path, headers=headers)
        assert status in (400, 403) and "Host" in err["error"], (method, path, err)
    status, err, _ = raw(server.port, "POST", "/jobs", JOB, headers | {"Content-Type": "application/json"})
    assert status in (400, 403) and "Host" in err["error"]
    # without a Host header at all (HTTP/1.0)
    assert raw(server.port, "GET", "/jobs", headers={})[0] == 400


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LocalHost:{port}", "[::1]:{port}"])
def test_the_loopback_names_are_answered(server, host):
    status, listing, _ = raw(server.port, "GET", "/jobs", headers={"Host": host.format(port=server.port)})
    assert status == 200 and "jobs" in listing


def test_host_and_origin_rules():
    from chunkflow.serve.guard import check

    local, names = ("127.0.0.1", 8000), frozenset({"gpu-box.lan"})

    def verdict(method="GET", path="/jobs", token=None, **headers):
        got = check(method, path, {k.replace("_", "-"): v for k, v in headers.items()}, local, names, token)
        return None if got is None else got[0]

    assert verdict(host="gpu-box.lan:8000") is None  # --host
    assert verdict(host="127.0.0.1:8000", origin="http://127.0.0.1:8000", method="POST") is None
    assert verdict(host="127.0.0.1:8000", origin="http://localhost:8000", method="POST") == 403
    assert verdict(host="[::1]:8000") is None and verdict(host="[::1]") == 403  # port 80 is not this server's
    assert verdict(host="evil.example:8000") == 403 and verdict(host="a:b:c") == 400
    assert check("GET", "/", {"host": "10.0.0.5:8000"}, ("10.0.0.5", 8000), frozenset(), None) is None  # by address
    token = "t" * 16
    assert verdict(host="127.0.0.1:8000", token=token) == 401
    assert verdict(host="127.0.0.1:8000", token=token, authorization="Bearer " + "t" * 15 + "u") == 401
    assert verdict(host="127.0.0.1:8000", token=token, authorization="Basic " + token) == 401
    assert verdict(host="127.0.0.1:8000", token=token, authorization="bearer " + token) is None
    assert verdict(host="127.0.0.1:8000", token=token, path="/") is None  # the page, which holds no job data
    assert verdict(host="127.0.0.1:8000", token=token, path="/", method="POST") == 401


def test_a_token_is_needed_on_every_route_but_the_page(server):
    from chunkflow.serve.app import make_app

    token = "s3cret-Token_0123456789"
    port, uv, thread = serve_app(make_app(server.queue, max_body_bytes=BODY_LIMIT, token=token))
    host = {"Host": f"127.0.0.1:{port}"}
    server.queue.pause()
    try:
        for method, path in [("GET", "/jobs"), ("GET", "/health"), ("GET", "/metrics"),
                             ("GET", "/jobs/" + "0" * 32 + "/result"), ("DELETE", "/jobs/" + "0" * 32)]:
            for auth in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": token}):
                status, err, headers = raw(port, method, path, headers=host | auth)
                assert status == 401 and headers["www-authenticate"].startswith("Bearer"), (method, path, auth)
                assert token not in json.dumps(err)
        status, err, _ = raw(port, "POST", "/jobs", JOB, host | {"Content-Type": "application/json"})
        assert status == 401 and len(server.queue) == 0
        status, page, _ = raw(port, "GET", "/", headers=host)
        assert status == 200 and b"tiny-wan" not in page  # the page is public: it names no model
        auth = host | {"Authorization": f"Bearer {token}"}
        status, snap, _ = raw(port, "POST", "/jobs", JOB, auth | {"Content-Type": "application/json"})
        assert status == 201
        assert raw(port, "GET", "/health", headers=auth)[1]["model"] == "tiny-wan"
        assert raw(port, "DELETE", f"/jobs/{snap['id']}", headers=auth)[0] == 200
    finally:
        server.queue.resume()
        uv.should_exit = True
        thread.join(WAIT_S)


def test_a_client_that_drops_mid_body_is_one_log_line(server, nothing_queued):
    import logging

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):  # on the server's loggers and the root: each record kept once
        def emit(self, record):
            if not any(r is record for r in records):
                records.append(record)

    handler, loggers = Keep(level=logging.DEBUG), [logging.getLogger(n) for n in ("uvicorn.error", "uvicorn", "")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
    logging.getLogger("uvicorn.error").setLevel(logging.INFO)
    try:
        for i in range(3):
            with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as s:
                s.sendall(f"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json"
                          f"\r\nContent-Length: 100000\r\n\r\n".encode() + JOB[:20])  # and gone
            wait_until(lambda: sum("went away" in r.getMessage() for r in records) > i, "the disconnect's line")
        gone = [r for r in records if "went away" in r.getMessage()]
        assert len(gone) == 3 and all("\n" not in r.getMessage() and r.exc_info is None for r in gone), gone
        assert not any(r.exc_info or "Exception in ASGI" in r.getMessage() for r in records), [
            r.getMessage() for r in records]
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)


# an image pipeline's queue: a stand-in session (what JobQueue asks of one), the real app and HTTP
class ImageSession:
    image = True
    device = "cpu"
    generations = 0
    closed = False

    def __init__(self):
        self.spec = type("Spec", (), {"name": "stand-in-i2v", "is_video": False})()
        self.got = []

    def fit(self, job, with_image=None):
        from chunkflow_planner.catalog import Workload

        w = Workload(height=job.height or 64, width=job.width or 64, steps=job.steps or 2)
        return type("Fit", (), {"reason": None, "workload": w})()

    def predicted_s(self, job, first):
        return None

    def generate(self, job, image=None, on_step=None, on_phase=None):
        self.got.append(image)
        out = type("Result", (), {"is_video": False, "seconds": 0.01, "predicted_s": None})()
        out.save = lambda path: (Path(path).write_bytes(b"png"), Path(path))[1]
        return out

    def close(self):
        self.closed = True


def png(width: int, height: int, noise: bool = True) -> bytes:
    import io

    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8) if noise else np.zeros((height, width, 3),
                                                                                                 np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def image_server(tmp_path):
    from chunkflow.serve.app import make_app
    from chunkflow.serve.queue import JobQueue

    session = ImageSession()
    queue = JobQueue(session, tmp_path / "out", max_queue=4, paused=True)
    port, uv, thread = serve_app(make_app(queue, max_body_bytes=BODY_LIMIT))
    server = type("S", (), {"url": f"http://127.0.0.1:{port}", "port": port, "queue": queue, "session": session})()
    try:
        yield server
    finally:
        uv.should_exit = True
        thread.join(WAIT_S)
        queue.shutdown(WAIT_S)


def test_a_queued_image_job_keeps_the_compressed_bytes_and_decodes_when_it_runs(image_server):
    from PIL import Image

    data = png(96, 64)
    status, snap, _ = call(image_server, "POST", "/jobs", {"prompt": "animate", "image_base64":
                                                           base64.b64encode(data).decode()})
    assert status == 201, snap
    kept = image_server.queue._jobs[snap["id"]].image
    assert type(kept) is bytes and kept == data  # the file as sent: not 96 x 64 x 3 decoded pixels
    image_server.queue.resume()
    assert finished(image_server, snap["id"])["state"] == "done"
    (got,) = image_server.session.got
    assert isinstance(got, Image.Image) and got.size == (96, 64) and got.mode == "RGB"
    assert image_server.queue._jobs[snap["id"]].image is None  # dropped once finished


@pytest.mark.parametrize("size, words", [((16385, 1), "16385 x 1 pixels"), ((1, 20000), "1 x 20000 pixels")])
def test_an_oversized_image_is_refused_at_submission_from_its_header(image_server, size, words):
    data = png(*size, noise=False)
    assert len(data) < 4096  # a few KB that would decode to far more
    body = {"prompt": "x", "image_base64": base64.b64encode(data).decode()}
    status, err, _ = call(image_server, "POST", "/jobs", body)
    assert status == 422 and words in err["error"] and len(image_server.queue) == 0, err


def test_a_damaged_image_fails_its_job_when_it_runs_and_the_next_runs(image_server):
    good, bad = png(32, 32), png(32, 32)[:200]  # a header that reads, pixels that do not
    ids = [call(image_server, "POST", "/jobs", {"prompt": p, "image_base64": base64.b64encode(d).decode()})[1]["id"]
           for p, d in (("bad", bad), ("good", good))]
    image_server.queue.resume()
    snaps = [finished(image_server, i) for i in ids]
    assert snaps[0]["state"] == "failed" and "image_base64 cannot be decoded" in snaps[0]["error"], snaps[0]
    assert snaps[1]["state"] == "done"


@pytest.mark.parametrize("args, env, words", [
    (["--host", "0.0.0.0"], {}, "--host 0.0.0.0 is not a loopback address"),
    (["--host", "192.168.1.2"], {}, "add --allow-remote"),
    (["--host", "0.0.0.0", "--allow-remote"], {}, "--allow-remote needs a token: set CHUNKFLOW_SERVE_TOKEN"),
    (["--host", "0.0.0.0", "--allow-remote"], {"CHUNKFLOW_SERVE_TOKEN": "short"}, "at least 16 characters"),
    ([], {"CHUNKFLOW_SERVE_TOKEN": "has spaces in it, more than 16"}, "CHUNKFLOW_SERVE_TOKEN must be"),
])
def test_serve_listens_beyond_loopback_only_with_the_flag_and_a_token(cli, setup, workdir, monkeypatch, args, env,
                                                                       words):
    import chunkflow.serve.server

    def no_bind(*a):
        raise AssertionError("serve bound a socket it should have refused")

    monkeypatch.setattr(chunkflow.serve.server, "bind", no_bind)  # never listens beyond loopback, even if broken
    monkeypatch.delenv("CHUNKFLOW_SERVE_TOKEN", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    result = cli("serve", "--plan", setup[1], *args)  # refused before anything is bound or loaded
    assert result.exit_code == 2 and words in " ".join(result.output.split()), result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_a_browser_uses_a_token_server_from_the_pages_fragment(server, tmp_path):
    from chunkflow.serve.app import make_app

    token = "browser-Token_0123456789"
    port, uv, thread = serve_app(make_app(server.queue, max_body_bytes=BODY_LIMIT, token=token))
    auth = {"Host": f"127.0.0.1:{port}", "Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    try:
        status, snap, _ = raw(port, "POST", "/jobs", JOB, auth)
        assert status == 201
        wait_until(lambda: server.queue.get(snap["id"])["state"] == "done", "the job")

        def dom(url: str) -> str:
            run = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                                  f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", url],
                                 capture_output=True, text=True, timeout=WAIT_S)
            assert "<tbody" in run.stdout, run.stderr[-2000:]
            return run.stdout

        page = dom(f"http://127.0.0.1:{port}/#token={token}")
        assert f'data-id="{snap["id"]}"' in page and '<span id="model">tiny-wan</span>' in page
        assert 'src="blob:' in page  # the result fetched with the token, shown from a blob: URL
        page = dom(f"http://127.0.0.1:{port}/")  # a new tab without the fragment: no token, nothing shown
        assert f'data-id="{snap["id"]}"' not in page and "needs its token" in page
    finally:
        uv.should_exit = True
        thread.join(WAIT_S)


def test_the_queued_jobs_images_together_are_capped_and_a_job_over_it_waits_for_room(tmp_path):
    """Each image is checked alone (the body limit, its header), and together the queued jobs' images are held to
    max_image_bytes: 64 jobs of ~24 MB would keep 1.5 GB from the model. A job past it is a 429 that says why,
    nothing is queued, and once a job finishes (its image dropped) the same request is taken."""
    from chunkflow.serve.app import make_app
    from chunkflow.serve.queue import JobQueue

    data = png(64, 64, noise=True)
    queue = JobQueue(ImageSession(), tmp_path / "out", max_queue=8, paused=True, max_image_bytes=2 * len(data) + 10)
    port, uv, thread = serve_app(make_app(queue, max_body_bytes=BODY_LIMIT))
    server = type("S", (), {"url": f"http://127.0.0.1:{port}", "port": port, "queue": queue})()
    body = {"prompt": "animate", "image_base64": base64.b64encode(data).decode()}
    try:
        first = [call(server, "POST", "/jobs", body) for _ in range(2)]
        assert [status for status, _, _ in first] == [201, 201]
        status, err, _ = call(server, "POST", "/jobs", body)
        assert status == 429 and "images hold" in err["error"] and len(queue) == 2, err
        queue.resume()
        for _, snap, _ in first:
            assert finished(server, snap["id"])["state"] == "done"
        status, snap, _ = call(server, "POST", "/jobs", body)
        assert status == 201, snap
    finally:
        uv.should_exit = True
        thread.join(WAIT_S)
        queue.shutdown(WAIT_S)
