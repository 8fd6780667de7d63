"""The `chunkflow serve` page in a real browser: the system's Chromium driven by Playwright (no browser download).

A real `chunkflow serve` (a subprocess) on the tiny Wan pipeline saved with save_pretrained, on the CPU: the form
filled (size, steps, a seed past 2**53, a negative prompt) and submitted, the job listed with its full id, its
result shown at its size and downloaded (the bytes the API serves), the settings it ran with, "no prediction" on a
CPU, a refused field's message beside the field, and the plan panel's values those of the plan file. Progress within
a running job is watched on the same app and queue in-process, its steps held one at a time by the queue's step
observer: the page shows step 1 of 3, then 2 of 3, whatever the machine's speed. Waits are hang guards, not timing
assertions."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pipelines import one_thread

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("imageio_ffmpeg")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium binary (install the distribution's chromium package: apt install chromium)")]
WAIT_S = 120
WAIT_MS = WAIT_S * 1000


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny Wan pipeline saved with save_pretrained, and a CPU plan for it."""
    from typer.testing import CliRunner

    from chunkflow.commands.cli import app
    from pipelines import save_catalog_pipeline

    root = tmp_path_factory.mktemp("page")
    with one_thread():
        folder = save_catalog_pipeline("tiny", root / "tiny", 3)
    plan = root / "plan.json"
    result = CliRunner().invoke(app, ["plan", "--model", "tiny", "--hardware", "cpu", "--host-mem-budget", "8GB",
                                      "--out", str(plan)], env={"CHUNKFLOW_CONFIG_DIR": str(root / "config")})
    assert result.exit_code == 0, result.output
    return root, plan, folder


@pytest.fixture(scope="module")
def served(setup):
    """`chunkflow serve` on a free port of 127.0.0.1: its URL, until the module's tests are done (then Ctrl-C)."""
    from conftest import SRC

    root, plan, folder = setup
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1", CHUNKFLOW_CONFIG_DIR=str(root / "config"))
    env.pop("CHUNKFLOW_SERVE_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "chunkflow", "serve", "--plan", str(plan), "--weights",
                             str(folder), "--device", "cpu", "--port", str(port), "--out-dir", str(root / "out"),
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        line = proc.stdout.readline()  # the URL, once the server accepts connections
        assert f"http://127.0.0.1:{port}/" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        yield f"http://127.0.0.1:{port}"
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=WAIT_S)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    """A fresh tab; the page's script errors fail the test."""
    context = browser.new_context(accept_downloads=True)
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda e: errors.append(str(e)))
    yield tab
    context.close()
    assert not errors, errors


def get(url: str) -> tuple[int, bytes, str]:
    """(status, body, content type) of a GET from the test, not the browser."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=WAIT_S) as r:
            return r.status, r.read(), r.headers.get("content-type", "")
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers.get("content-type", "")


def card(page, job_id: str):
    return page.locator(f'.job[data-id="{job_id}"]')


def submit(page, **fields: str) -> str:
    """Fill the form's `fields` (by input id), press Generate; the message the page then shows."""
    for name, value in fields.items():
        page.fill(f"#{name}", value)
    before = page.text_content("#message")
    page.click("#submit-button")
    page.wait_for_function("b => document.getElementById('message').textContent !== b", arg=before, timeout=WAIT_MS)
    return page.text_content("#message")


def test_a_person_generates_from_the_page_and_downloads_the_result(served, setup, page):
    plan = json.loads(setup[1].read_text())
    page.goto(served + "/")
    page.wait_for_selector("#plan-components tbody tr", timeout=WAIT_MS)
    w = plan["workload"]  # the form's defaults are the plan's
    assert [page.input_value(f"#{k}") for k in ("steps", "width", "height", "frames")] == [
        str(w[k]) for k in ("steps", "width", "height", "frames")]
    seed = "12345678901234567"  # past 2**53: a JavaScript number would round it
    said = submit(page, prompt="a red fox in the snow", negative_prompt="blurry, dark", seed=seed, steps="3",
                  width="48", height="32")
    assert said.startswith("submitted job "), said
    job_id = said.removeprefix("submitted job ")
    assert len(job_id) == 32 and all(c in "0123456789abcdef" for c in job_id)
    job = card(page, job_id)
    assert job.locator(".job-id").text_content() == job_id  # the full id, as the API takes it
    page.wait_for_selector(f'.job[data-id="{job_id}"][data-state="done"] .result a', timeout=WAIT_MS)

    status, body, _ = get(f"{served}/jobs/{job_id}")
    snap = json.loads(body)
    assert snap["state"] == "done" and snap["seed"] == int(seed) and snap["negative_prompt"] == "blurry, dark"
    assert snap["settings"]["seed"] == seed and (snap["width"], snap["height"], snap["steps"]) == (48, 32, 3)
    settings = job.locator(".settings").text_content()
    assert f"seed {seed}" in settings and "3 steps" in settings and "48x32" in settings
    assert f"{w['frames']} frames" in settings and "negative: blurry, dark" in settings
    times = job.locator(".times").text_content()
    assert times.startswith("measured ") and "no prediction" in times  # a CPU: the plan's times are nominal

    video = job.locator(".result video")
    assert (video.get_attribute("width"), video.get_attribute("height")) == ("48", "32")  # its real size
    page.wait_for_function("v => v.readyState >= 1", arg=video.element_handle(), timeout=WAIT_MS)
    assert video.evaluate("v => [v.videoWidth, v.videoHeight]") == [48, 32]  # the browser decoded the mp4
    link = job.locator(".result a")
    assert link.get_attribute("href") == f"/jobs/{job_id}/result"
    with page.expect_download(timeout=WAIT_MS) as download:
        link.click()
    got = Path(download.value.path()).read_bytes()
    status, served_bytes, kind = get(f"{served}/jobs/{job_id}/result")
    assert status == 200 and kind == "video/mp4" and got == served_bytes and got[4:8] == b"ftyp"
    assert download.value.suggested_filename == f"{job_id}.mp4"


def test_a_refused_field_is_marked_with_the_apis_message(served, page):
    page.goto(served + "/")
    page.wait_for_selector("#plan-components tbody tr", timeout=WAIT_MS)
    before = json.loads(get(f"{served}/jobs")[1])["jobs"]
    said = submit(page, prompt="a fox", width="50")
    status, body, _ = get(f"{served}/jobs")
    assert "not queued" in said and json.loads(body)["jobs"] == before  # nothing was queued
    message = page.text_content("#error-width")
    assert "divisible by 16" in message and "Nearest valid: 48 or 64" in message
    assert "invalid" in page.get_attribute("#width", "class") and page.text_content("#error-height") == ""
    page.click("#reset-defaults")  # back to the plan's values, the mark gone
    assert page.input_value("#width") == "64" and page.text_content("#error-width") == ""


def test_the_plan_panel_shows_the_plan_file(served, setup, page):
    from chunkflow_planner.units import format_bytes, format_seconds

    plan = json.loads(setup[1].read_text())
    page.goto(served + "/")
    page.wait_for_selector("#plan-components tbody tr", timeout=WAIT_MS)
    rows = page.locator("#plan-components tbody tr")
    comps = plan["pipeline"]["components"]
    assert rows.count() == len(comps)
    where = {"cpu": "CPU", "gpu": "device (the CPU)"}  # a CPU plan: its "GPU" is the CPU itself
    held = {"cpu": "host memory", "gpu": "device (the CPU) memory, throughout"}
    for row, c in zip(rows.all(), comps):
        cells = [td.text_content() for td in row.locator("td").all()]
        host = plan["prediction"]["host_memory"].get(c["name"])
        assert cells[0] == c["name"] and cells[1].startswith(where[c["placement"]]), cells
        assert cells[2] == held[c["placement"]] and cells[3] == format_bytes(c["bytes"]), cells
        assert cells[4] == (format_bytes(host) if host else "-"), cells
    pp = plan["prediction"]
    summary = {dd.get_attribute("data-key"): dd.text_content() for dd in page.locator("#plan-summary dd").all()}
    assert summary["step-time"] == format_seconds(pp["step_time_s"])
    assert summary["generation-time"].startswith(format_seconds(pp["generation_time_s"]))
    assert summary["host-memory"] == (f"{format_bytes(pp['host_memory_bytes'])} of "
                                      f"{format_bytes(plan['host_memory_budget_bytes'])} budget")
    assert summary["model"] == "tiny-wan" and summary["device"] == "cpu" and summary["offload"] == "none"
    phases = [[td.text_content() for td in r.locator("td").all()] for r in page.locator("#plan-phases tbody tr").all()]
    assert phases == [[n, format_seconds(pp["phases"][n]["time_s"]), format_bytes(pp["phases"][n]["peak_memory_bytes"])]
                      for n in ("encode", "denoise", "decode")]
    assert page.text_content("#plan-note").startswith("No prediction: on a CPU the plan's times are nominal")


class Stepper:
    """The queue's step observer: each denoising step waits in the worker until the test lets it go on."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.reached, self.allowed = 0, 0

    def __call__(self, job_id: str, i: int, n: int) -> None:
        with self.cond:
            self.reached = i
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: self.allowed >= i or self.allowed < 0, WAIT_S)

    def wait_for(self, i: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.reached >= i, WAIT_S), f"step {i} not reached"

    def allow(self, i: int) -> None:
        with self.cond:
            self.allowed = i
            self.cond.notify_all()


@pytest.fixture
def stepped(setup, tmp_path):
    """The app and queue `chunkflow serve` runs, in this process, its steps held by a Stepper: (URL, stepper)."""
    import chunkflow
    from chunkflow.serve.app import make_app
    from chunkflow.serve.queue import JobQueue
    from test_serve import serve_app

    root, plan, folder = setup
    stepper = Stepper()
    with one_thread():
        session = chunkflow.load(plan, weights=folder, device="cpu")
        queue = JobQueue(session, tmp_path / "out", observer=stepper)
        port, server, thread = serve_app(make_app(queue))
        try:
            yield f"http://127.0.0.1:{port}", stepper
        finally:
            stepper.allow(-1)
            server.should_exit = True
            thread.join(WAIT_S)
            queue.shutdown(WAIT_S)


def test_the_page_shows_a_running_jobs_progress_move(stepped, page):
    url, stepper = stepped
    page.goto(url + "/")
    page.wait_for_selector("#plan-components tbody tr", timeout=WAIT_MS)
    job_id = submit(page, prompt="a slow fox", steps="3").removeprefix("submitted job ")
    later_id = submit(page, prompt="the next one", steps="1").removeprefix("submitted job ")
    progress = f'.job[data-id="{job_id}"] .progress-text'
    for step in (1, 2):
        stepper.wait_for(step)  # the worker waits inside this step: the API says it
        page.wait_for_function(f"() => (document.querySelector('{progress}') || {{}}).textContent === "
                               f"' denoising · step {step}/3'", timeout=WAIT_MS)
        bar = page.locator(f'.job[data-id="{job_id}"] progress')
        assert abs(float(bar.evaluate("b => b.value")) - step / 3) < 1e-6
        running = card(page, job_id)
        assert running.locator(".state").text_content() == "running"
        assert running.locator(".times").text_content() == "no prediction"  # a CPU: none, said
        assert running.locator(".cancel").is_visible()
        queued = card(page, later_id)
        assert queued.locator(".state").text_content() == "queued (#1)"
        assert queued.locator(".times").text_content() == "no prediction"
        stepper.allow(step)
    stepper.allow(10)
    page.wait_for_selector(f'.job[data-id="{later_id}"][data-state="done"]', timeout=WAIT_MS)
    assert card(page, job_id).get_attribute("data-state") == "done"
    assert card(page, job_id).locator(".progress-text").count() == 0  # the bar goes once the job is done


@pytest.fixture
def image_served(tmp_path):
    """The tiny image-to-video pipeline (tiny-ti2v, saved with save_pretrained) loaded with image=True, behind the
    app `chunkflow serve --image` runs, in this process: (URL, plan, folder, output folder)."""
    pytest.importorskip("ftfy")  # Wan's image-to-video pipeline cleans every prompt with it
    import chunkflow
    from typer.testing import CliRunner

    from chunkflow.commands.cli import app
    from chunkflow.serve.app import make_app
    from chunkflow.serve.queue import JobQueue
    from pipelines import save_catalog_pipeline
    from test_serve import serve_app

    with one_thread():
        folder = save_catalog_pipeline("tiny-ti2v", tmp_path / "ti2v", 3)
    plan = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", "--model", "tiny-ti2v", "--hardware", "cpu", "--host-mem-budget",
                                      "8GB", "--out", str(plan)], env={"CHUNKFLOW_CONFIG_DIR": str(tmp_path / "c")})
    assert result.exit_code == 0, result.output
    with one_thread():
        session = chunkflow.load(plan, weights=folder, device="cpu", image=True)
        queue = JobQueue(session, tmp_path / "out")
        port, server, thread = serve_app(make_app(queue))
        try:
            yield f"http://127.0.0.1:{port}", plan, folder, tmp_path / "out"
        finally:
            server.should_exit = True
            thread.join(WAIT_S)
            queue.shutdown(WAIT_S)


def test_an_image_is_uploaded_from_the_page_and_animated(image_served, page, tmp_path):
    import numpy as np
    from PIL import Image

    import chunkflow
    from chunkflow.media import read_video

    url, plan, folder, out = image_served
    picture = tmp_path / "picture.png"
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 255, (40, 56, 3), dtype=np.uint8)).save(picture)
    page.goto(url + "/")
    page.wait_for_selector("#plan-components tbody tr", timeout=WAIT_MS)
    said = submit(page, prompt="the picture comes alive")  # no image yet: the API's reason beside the field
    assert "not queued" in said and "send one (image_base64" in page.text_content("#error-image")
    page.set_input_files("#image", str(picture))
    said = submit(page, seed="4")
    assert said.startswith("submitted job "), said
    job_id = said.removeprefix("submitted job ")
    page.wait_for_selector(f'.job[data-id="{job_id}"][data-state="done"] .result video', timeout=WAIT_MS)
    served = read_video(out / f"{job_id}.mp4")
    with one_thread(), chunkflow.load(plan, weights=folder, device="cpu", image=True) as other:
        want = other.generate("the picture comes alive", seed=4, image=Image.open(picture).convert("RGB"))
        expected = read_video(want.save(tmp_path / "expected.mp4"))
    np.testing.assert_array_equal(served, expected)  # the uploaded file is the image the job animated
