"""The HTTP API over a JobQueue (FastAPI): submit, watch, fetch and cancel jobs; the loaded plan (GET /plan, as the
page shows it: serve.plan_view), health, metrics and the page.

Every error is JSON `{"error": "..."}` saying what was wrong: 400 a body that is not JSON or an id that is not one,
401 a missing or wrong token, 403 a Host, Origin or cross-site request the server does not answer (serve.guard),
404 an unknown job, 409 a result not ready (or a job that will have none), 413 a body over the limit (checked from
Content-Length and again while it is read), 415 a job not sent as application/json, 422 a job that is malformed or
does not fit the loaded placement (the planner's reason; `fields` then names the job's fields it is about, for a
form to show it beside them; a job naming a `cache`: the server's is chosen when it starts), 429 a full queue, 503
a server shutting down. Request bodies never name files: an input image comes as base64 bytes, an output is named by its job id. A queued job keeps
its image as the compressed bytes it came as (checked from the header: format, bytes, pixels), decoded when it runs.
A client that goes away mid-body is one log line.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
from typing import Any

from chunkflow.serve import require_serve_extras

require_serve_extras()

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response  # noqa: E402
from starlette.concurrency import run_in_threadpool  # noqa: E402
from starlette.exceptions import HTTPException as StarletteHTTPException  # noqa: E402
from starlette.requests import ClientDisconnect  # noqa: E402

from chunkflow.serve.guard import Guard  # noqa: E402
from chunkflow.serve.metrics import CONTENT_TYPE, render_metrics  # noqa: E402
from chunkflow.serve.page import page_policy, render_page  # noqa: E402
from chunkflow.serve.plan_view import plan_view  # noqa: E402
from chunkflow.serve.queue import JobQueue, QueueClosed, QueueFull, UnknownJob, cache_label_of  # noqa: E402
from chunkflow_planner.errors import ChunkflowError  # noqa: E402
from chunkflow_planner.pipeline.jobs import Job, JobError, JobJSONError, load_json, parse_job  # noqa: E402

__all__ = ["make_app", "MAX_BODY_BYTES"]

MAX_BODY_BYTES = 32 * 2**20  # a job's JSON with a base64 image of ~24 MB
_ID = re.compile(r"[0-9a-f]{32}")
FIELDS = ("prompt", "negative_prompt", "seed", "guidance", "steps", "height", "width", "frames", "image_base64",
          "cache")
_NAMED = re.compile(r"\b(negative_prompt|image_base64|guidance|seed|steps|height|width|frames)\b")
_MEDIA = {".mp4": "video/mp4", ".png": "image/png"}
_log = logging.getLogger("uvicorn.error")  # the server's own log: one format, one --log-level


class _Gone(Exception):
    """The client went away before its body was all sent."""


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def error_fields(message: str) -> list[str]:
    """The job fields a refusal is about: those it names first ("steps: ...; seed: ..." from the job's checks),
    else a shape over a budget ("give a smaller size": height, width, frames), else the negative prompt or image it
    names, else the first field it names."""
    if "a smaller size" in message:
        return ["height", "width", "frames"]
    named = [part.split(":", 1)[0].strip() for part in message.split("; ")]
    first = [n for n in named if n in FIELDS]
    if first:
        return list(dict.fromkeys(first))
    found = _NAMED.findall(message)
    for field in ("negative_prompt", "image_base64"):  # "leave negative_prompt out" names guidance as the way
        if field in found:
            return [field]
    return found[:1]


def _refused(message: str) -> JSONResponse:
    """A 422: the job does not fit or is malformed; `fields` names the fields it is about."""
    return JSONResponse({"error": message, "fields": error_fields(message)}, status_code=422)


def takes_negative(spec) -> bool:
    """Whether the loaded pipeline uses a negative prompt (the page shows the field only then)."""
    if getattr(spec, "pipeline", None) is None:
        return False
    from chunkflow.models.adapters import negative_prompt_refusal

    return negative_prompt_refusal(spec) is None


def _check_id(job_id: str) -> JSONResponse | None:
    if _ID.fullmatch(job_id) is None:
        return _error(400, "a job id is 32 lowercase hex digits, as POST /jobs answered it")
    return None


async def _read_body(request: Request, limit: int) -> bytes | JSONResponse:
    """The request's body, at most `limit` bytes: refused from its Content-Length before any is read, and again
    while it is streamed (a body sent without one, or longer than it said)."""
    too_big = _error(413, f"the request body is over {limit:,} bytes; send a smaller image (the pipeline resizes "
                          "it to the plan's size anyway)")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            return _error(400, "the Content-Length header is not a number")
        if int(declared) > limit:
            return too_big
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return too_big
            chunks.append(chunk)
    except ClientDisconnect:
        raise _Gone(f"{size:,} of {declared or 'unsaid'} bytes") from None
    return b"".join(chunks)


def _json_type(content_type: str | None) -> JSONResponse | None:
    """A 415 unless the body is declared application/json (a charset, if said, UTF-8). A page of another site can
    send text/plain, a form or no type without asking the server first (no CORS preflight): none is read."""
    media, *params = (content_type or "").split(";")
    charset = [p.split("=", 1)[1].strip().strip('"').lower() for p in params
               if p.strip().lower().startswith("charset=")]
    if media.strip().lower() == "application/json" and all(c in ("utf-8", "utf8") for c in charset):
        return None
    got = f"not {content_type.strip()!r}" if content_type else "the request had none"
    return _error(415, f"a job is sent as JSON with the header Content-Type: application/json ({got})")


def _image_bytes(value: Any) -> bytes:
    """image_base64 -> the image file's bytes, checked from its header (format, bytes, pixels:
    media.check_input_image_bytes), not decoded; JobError says what is wrong."""
    from chunkflow.media import MediaError, check_input_image_bytes

    if not isinstance(value, str):
        raise JobError("image_base64 must be a string: the image file's bytes in base64")
    text = value.split(",", 1)[1] if value.startswith("data:") and "," in value else value  # a data: URL too
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise JobError("image_base64 is not valid base64; give the image file's bytes base64-encoded") from None
    try:
        check_input_image_bytes(data, "image_base64")
    except MediaError as exc:
        raise JobError(str(exc)) from None
    return data


def make_app(queue: JobQueue, *, max_body_bytes: int = MAX_BODY_BYTES, title: str | None = None,
             token: str | None = None, hosts: tuple[str, ...] = ()) -> FastAPI:
    """The API over `queue` (module docstring); the queue's session names the model and device. Every request
    passes serve.guard first: `hosts` the Host names it answers to besides the loopback ones and the address a
    connection arrived on; `token` (None: none) the bearer token every request but the page must carry."""
    session = queue.session
    model = session.spec.name
    negative = takes_negative(session.spec)
    app = FastAPI(title=title or f"chunkflow serve: {model}", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, names=hosts, token=token)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    _add_job_routes(app, queue, max_body_bytes)
    _add_status_routes(app, queue, max_body_bytes)
    _add_page_route(app, queue, token, negative)
    return app


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown path, a method a route does not take) as JSON, like every other."""
    return _error(exc.status_code, str(exc.detail))


def _add_job_routes(app: FastAPI, queue: JobQueue, max_body_bytes: int) -> None:
    """POST /jobs, GET /jobs, GET /jobs/{id}, GET /jobs/{id}/result and DELETE /jobs/{id} on `app`."""

    @app.post("/jobs", status_code=201)
    async def submit(request: Request) -> Response:
        return await _submit_job(request, queue, max_body_bytes)

    @app.get("/jobs")
    def list_jobs() -> dict:
        return {"queue_length": len(queue), "paused": queue.paused, "jobs": queue.jobs()}

    @app.get("/jobs/{job_id}")
    def get_job(job_id: str) -> Response:
        return _job_state(queue, job_id)

    @app.get("/jobs/{job_id}/result")
    def get_result(job_id: str) -> Response:
        return _job_result(queue, job_id)

    @app.delete("/jobs/{job_id}")
    def cancel_job(job_id: str) -> Response:
        return _cancel_job(queue, job_id)


async def _submit_job(request: Request, queue: JobQueue, max_body_bytes: int) -> Response:
    """POST /jobs: the body read (_job_body), parsed and checked (_submitted_job), the job queued: 201 with its
    snapshot and Location, else the error (module docstring)."""
    body = await _job_body(request, max_body_bytes)
    if isinstance(body, Response):
        return body
    try:
        data = load_json(body)
    except JobJSONError as exc:
        return _error(400, f"the body is {exc}; send a JSON object such as "
                           '{"prompt": "a red fox in the snow", "seed": 1}')
    try:
        job, image = _submitted_job(data)
        snap = await run_in_threadpool(queue.submit, job, image)
    except QueueFull as exc:
        return _error(429, str(exc))
    except QueueClosed as exc:
        return _error(503, str(exc))
    except ChunkflowError as exc:
        return _refused(str(exc))
    return JSONResponse(snap, status_code=201, headers={"Location": f"/jobs/{snap['id']}"})


async def _job_body(request: Request, max_body_bytes: int) -> bytes | Response:
    """A submitted job's body: a 415 unless it is declared JSON, a 413 over `max_body_bytes`, a 400 (and one log
    line) where the client went away before it was all sent."""
    if (bad := _json_type(request.headers.get("content-type"))) is not None:
        return bad
    try:
        return await _read_body(request, max_body_bytes)
    except _Gone as gone:
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        _log.info("%s went away while sending a job (%s received); nothing queued", client, gone)
        return _error(400, "the client went away before the body was sent")


def _submitted_job(data: Any) -> tuple[Job, bytes | None]:
    """A submitted JSON value as (the job, its image's bytes or None); JobError (or the job's own ChunkflowError)
    says what is wrong: not an object, a bad image, a field the server chooses itself."""
    if not isinstance(data, dict):
        raise JobError(f'a job is a JSON object with at least "prompt", not {type(data).__name__}')
    image = None
    if "image_base64" in data:
        image = _image_bytes(data.pop("image_base64"))
    if "image" in data:
        raise JobError("image: the server takes no image path; send the image itself as image_base64 (a "
                       "base64 PNG, JPEG or WebP)")
    if "cache" in data:
        raise JobError("cache: the server's step cache is chosen when it starts (chunkflow serve --cache "
                       "KIND[:PARAMS]); a job runs with it and cannot choose another: leave \"cache\" out")
    if "out" in data:
        raise JobError('out: the server names each output by its job id; leave "out" out and fetch '
                       "/jobs/<id>/result")
    return parse_job(data, strict=True), image


def _job_state(queue: JobQueue, job_id: str) -> Response:
    """GET /jobs/{id}: the job's snapshot."""
    if (bad := _check_id(job_id)) is not None:
        return bad
    try:
        return JSONResponse(queue.get(job_id))
    except UnknownJob as exc:
        return _error(404, str(exc))


def _job_result(queue: JobQueue, job_id: str) -> Response:
    """GET /jobs/{id}/result: the job's output file; 409 while it has none, 404 once it is gone."""
    if (bad := _check_id(job_id)) is not None:
        return bad
    try:
        state, path = queue.output_path(job_id)
    except UnknownJob as exc:
        return _error(404, str(exc))
    if path is None:
        why = {"queued": "is queued", "running": "is running", "failed": "failed: it has no result",
               "cancelled": "was cancelled: it has no result"}.get(state, state)
        return _error(409, f"job {job_id} {why}; GET /jobs/{job_id} says when it is done")
    if not path.is_file():
        return _error(404, f"job {job_id}'s output is no longer in the server's output folder")
    return FileResponse(path, media_type=_MEDIA.get(path.suffix, "application/octet-stream"), filename=path.name)


def _cancel_job(queue: JobQueue, job_id: str) -> Response:
    """DELETE /jobs/{id}: the job cancelled, its snapshot; 409 for one that has finished."""
    if (bad := _check_id(job_id)) is not None:
        return bad
    try:
        snap = queue.cancel(job_id)
    except UnknownJob as exc:
        return _error(404, str(exc))
    if snap["state"] in ("done", "failed"):
        return _error(409, f"job {job_id} has finished ({snap['state']}); there is nothing to cancel")
    return JSONResponse(snap)


def _add_status_routes(app: FastAPI, queue: JobQueue, max_body_bytes: int) -> None:
    """GET /health, /plan and /metrics on `app`."""
    session = queue.session
    model = session.spec.name

    @app.get("/health")
    def health() -> dict:
        return {"ok": not queue.closed, "model": model, "device": str(session.device),
                "image": bool(getattr(session, "image", False)), "video": bool(session.spec.is_video),
                "queue_length": len(queue), "max_queue": queue.max_queue, "paused": queue.paused,
                "cache": cache_label_of(session)}

    @app.get("/plan")
    def plan() -> dict:
        return plan_view(session, max_body_bytes)

    @app.get("/metrics")
    def metrics() -> Response:
        return PlainTextResponse(render_metrics(queue), media_type=CONTENT_TYPE)


def _add_page_route(app: FastAPI, queue: JobQueue, token: str | None, negative: bool) -> None:
    """GET / on `app`: the page, with its Content-Security-Policy; `negative`: whether it shows the negative
    prompt's field."""
    session = queue.session
    model = session.spec.name

    @app.get("/", response_class=HTMLResponse)
    def page() -> HTMLResponse:
        # with a token the page is served to anyone who reaches the server: it names no model (it asks /health)
        text = render_page(None if token else model, image=bool(getattr(session, "image", False)),
                           video=bool(session.spec.is_video), negative=negative)
        return HTMLResponse(text, headers={"Content-Security-Policy": page_policy(text),
                                           "X-Frame-Options": "DENY", "Cache-Control": "no-store"})
