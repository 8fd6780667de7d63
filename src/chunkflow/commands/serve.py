"""`chunkflow serve`: a plan's pipeline loaded once and served over HTTP (chunkflow.serve): a job queue, its worker,
a small page. Every option is checked before the load; Ctrl-C (or SIGTERM) stops it cleanly: the running job
stops after its current step, the queued ones are cancelled, the session is closed, exit 0. Who may use it is
serve.guard's: loopback only unless --allow-remote, which needs a token (CHUNKFLOW_SERVE_TOKEN). `--cache` (else the
plan's cache) is every job's step cache, checked before the port is taken."""

from __future__ import annotations

import os

from pathlib import Path
from typing import Annotated, Optional

import typer

from chunkflow.commands.app import UserError, _command, _say, console, err_console
from chunkflow.commands.options import INPUT, OUTPUT, Device, Variant

_Plan = Annotated[str, typer.Option("--plan", "-p", help="plan file written by `chunkflow plan --out`"), INPUT]
_Weights = Annotated[Optional[str], typer.Option(help="diffusers pipeline folder (model_index.json) or a Hub id in "
                                                      "the local cache (default: random weights)"), INPUT]
_Host = Annotated[str, typer.Option(help="address to listen on: a loopback address (127.0.0.1, ::1, localhost) "
                                         "unless --allow-remote is given")]
_AllowRemote = Annotated[bool, typer.Option("--allow-remote", help="let --host be an address other machines reach "
                                                                   "(0.0.0.0, a LAN address); requires a token in "
                                                                   "CHUNKFLOW_SERVE_TOKEN")]
_Port = Annotated[int, typer.Option(help="TCP port to listen on (1-65535)")]
_OutDir = Annotated[str, typer.Option(help="folder the server writes each job's output to, named by its job id "
                                           "(created if missing)"), OUTPUT]
_MaxQueue = Annotated[int, typer.Option(help="jobs that may wait at once; more are refused (HTTP 429)")]
_Image = Annotated[bool, typer.Option("--image", help="load the image pipeline of the plan's model "
                                                      "(image-to-video, edit): each job sends its image")]
_Transformer = Annotated[Optional[str], typer.Option(help="with --weights: read the transformer from this single file "
                                                           "(a GGUF file), the rest of the pipeline from the folder"),
                        INPUT]
_Transformer2 = Annotated[Optional[str], typer.Option(help="as --transformer, for the second expert (transformer_2)"),
                         INPUT]
_LogLevel = Annotated[str, typer.Option(help="the HTTP server's log: debug, info (each request), warning, error")]
_Cache = Annotated[Optional[str], typer.Option(help="a step cache of diffusers' every job runs with, KIND[:PARAMS] as "
                                                    "`run --cache` takes it (e.g. first-block:0.1, mag:ratios=flux); "
                                                    "default: the plan's (plan --cache). Each job's result says what "
                                                    "it skipped; a job cannot choose another")]

MAX_QUEUE_LIMIT = 10_000
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@_command("serve")
def serve_cmd(plan: _Plan, weights: _Weights = None, host: _Host = "127.0.0.1", port: _Port = 8000,
              out_dir: _OutDir = "chunkflow-serve-outputs", max_queue: _MaxQueue = 64, device: Device = None,
              variant: Variant = None, image: _Image = False, log_level: _LogLevel = "info",
              allow_remote: _AllowRemote = False, transformer: _Transformer = None,
              transformer_2: _Transformer2 = None, cache: _Cache = None) -> None:
    """Serve a plan's pipeline over HTTP: load it once, then generate each job submitted (POST /jobs) in turn.

    Jobs are JSON (prompt, seed, steps, height, width, frames, ...), checked against the loaded placement when they
    are submitted (one that does not fit is refused with the planner's reason). GET /jobs/ID says a job's state
    and predicted finish, GET /jobs/ID/result gives its video or image, DELETE /jobs/ID cancels it; GET / is a
    page to use it from a browser, /health and /metrics (Prometheus) watch it.

    Listens on 127.0.0.1. It answers only requests whose Host is 127.0.0.1, localhost, [::1] or --host (with its
    port), takes a job only as Content-Type: application/json, and refuses any other site's page (its Origin, or
    a cross-site fetch). A token in the environment variable CHUNKFLOW_SERVE_TOKEN (16 or more of A-Z a-z 0-9 - . _
    ~ + /) is then required on every request but the page: `Authorization: Bearer <token>`; in a browser open
    http://HOST:PORT/#token=<token> (the fragment never reaches the server; the page keeps it for the tab).
    --allow-remote lets --host be a non-loopback address and requires the token.
    """
    from chunkflow.serve import require_serve_extras

    require_serve_extras()
    p, folder = _check_serve(plan, weights, port, out_dir, max_queue, image, log_level)
    files = {k: v for k, v in (("transformer", transformer), ("transformer_2", transformer_2)) if v}
    if files:
        from chunkflow.models.transformer_file import check_files
        from chunkflow_planner.plan import model_of

        check_files(model_of(p), folder, files)  # headers against the folder's configs, before the port and load
    from chunkflow.models.transformer_file import check_plan_format

    check_plan_format(p, files)  # the plan's format against the file's (or the folder's own weights)
    setting = _check_cache(cache, p)
    token = _check_access(host, allow_remote)
    from chunkflow.serve.server import bind

    sock = bind(host, port)  # a port in use is said now, not after the load
    try:
        session = _load(plan, folder, device, variant, image, files, setting)
    except BaseException:
        sock.close()
        raise
    _serve(session, sock, host, port, Path(out_dir).expanduser(), max_queue, log_level, token)


def _check_access(host: str, allow_remote: bool) -> str | None:
    """The server's token (CHUNKFLOW_SERVE_TOKEN, checked; None if unset), once --host is allowed: a loopback
    address, or any with --allow-remote and a token."""
    from chunkflow.serve.guard import TOKEN_ENV, check_token
    from chunkflow.serve.server import is_loopback

    token = os.environ.get(TOKEN_ENV)
    if token is not None:
        try:
            check_token(token)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    if not is_loopback(host):
        if not allow_remote:
            raise UserError(f"--host {host} is not a loopback address: other machines could use the server; add "
                            f"--allow-remote (with a token in {TOKEN_ENV}) or listen on 127.0.0.1")
        if token is None:
            raise UserError(f"--allow-remote needs a token: set {TOKEN_ENV} (such as the output of: python -c "
                            "'import secrets; print(secrets.token_urlsafe(32))'); every request must then send it")
    return token


def _check_serve(plan: str, weights: str | None, port: int, out_dir: str, max_queue: int, image: bool,
                 log_level: str):
    """Every option checked before the load: the port and queue bounds, the output folder writable, the plan
    loading and having a pipeline, the weights folder the plan's model's. Returns (plan, weights folder)."""
    from chunkflow_planner.files import check_output_dir
    from chunkflow_planner.plan import files_needed, load_plan, model_of

    if not 1 <= port <= 65535:
        raise UserError(f"--port must be between 1 and 65535, got {port}")
    if not 1 <= max_queue <= MAX_QUEUE_LIMIT:
        raise UserError(f"--max-queue must be between 1 and {MAX_QUEUE_LIMIT}, got {max_queue}")
    if log_level.lower() not in LOG_LEVELS:
        raise UserError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
    check_output_dir(out_dir, "--out-dir")
    p = load_plan(plan)
    spec = model_of(p)
    if spec.pipeline is None or p.pipeline is None:
        raise UserError(f"the plan has no pipeline to serve ({spec.name}: planned for the transformer only); plan "
                        "the whole pipeline (`chunkflow plan --model ...` without --transformer-only)")
    why = files_needed(p)
    if why is not None and weights is None:
        raise UserError(why)
    folder = None
    if weights is not None:
        from chunkflow.models.pipeline_build import check_folder
        from chunkflow.weights import resolve_weights

        folder = resolve_weights(weights)
        check_folder(spec, folder, image=image)
    return p, folder


def _check_cache(text: str | None, p):
    """`--cache` parsed (one line where it is bad), else the plan's cache; tried on the model's transformer on the
    meta device before the port is taken and the pipeline loaded. None: no cache."""
    from chunkflow.caches import check_fits, resolve_cache
    from chunkflow_planner.plan import model_of

    setting = resolve_cache("plan" if text is None else text, p, "--cache")
    if setting is not None:
        check_fits(setting, model_of(p), p.workload.steps)
    return setting


def _load(plan: str, folder, device: str | None, variant: str | None, image: bool, files: dict[str, str],
          cache=None):
    """The session (every generation with `cache`, a checked CacheSetting or None), its load's bytes on a progress
    bar (stderr)."""
    import chunkflow
    from chunkflow_planner.units import format_bytes

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                   TimeElapsedColumn(), console=err_console, transient=False)
    with bar:
        task = bar.add_task("load", total=None, count="")

        def progress(phase: str, done: int | None, total: int | None) -> None:
            count = f"{format_bytes(done or 0)} of {format_bytes(total or 0)}" if total else "random weights"
            bar.update(task, completed=done or 0, total=total or None, count=count)

        session = chunkflow.load(plan, weights=folder, device=device, variant=variant, image=image,
                                 transformer=files.get("transformer"), transformer_2=files.get("transformer_2"),
                                 progress=progress, log=_say, cache=cache)
        t = bar.tasks[task]
        bar.update(task, completed=t.total or 1, total=t.total or 1, count=t.fields["count"] or "done")
    return session


def _serve(session, sock, host: str, port: int, out_dir: Path, max_queue: int, log_level: str,
           token: str | None = None) -> None:
    """Run the server until it is stopped (Ctrl-C, SIGTERM), then stop everything in order: the HTTP server (no
    new requests), the queue (the running job after its current step, the queued ones cancelled), the session."""
    from chunkflow.serve.app import make_app
    from chunkflow.serve.queue import JobQueue
    from chunkflow.serve.server import BackgroundServer
    from chunkflow.signals import Terminated
    from chunkflow_planner.files import note_interrupt

    try:
        queue = JobQueue(session, out_dir, max_queue=max_queue)
    except BaseException:
        session.close()
        raise
    server = BackgroundServer(make_app(queue, token=token, hosts=(host,)), sock, log_level=log_level.lower())
    stopped_by = None
    try:
        server.start()
        shown_host = f"[{host}]" if ":" in host else host
        console.print(f"Serving {session.spec.name} on {session.device} at http://{shown_host}:{port}/ "
                      f"(outputs in {out_dir}); Ctrl-C stops it", markup=False, highlight=False)
        if session.cache is not None:
            from chunkflow_planner.cache import cache_label

            _say(f"every job runs with the step cache {cache_label(session.cache)}")
        if token is not None:
            _say(f"every request needs the token (Authorization: Bearer); in a browser open "
                 f"http://{shown_host}:{port}/#token=<the token>")
        server.wait()
    except (KeyboardInterrupt, Terminated) as exc:
        stopped_by = "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C"
        _say(f"stopping ({stopped_by}): the running job stops after its current step, queued jobs are cancelled")
    finally:
        server.stop()
        queue.shutdown()
    if stopped_by is not None:
        # the signal asked the server to stop and it has, cleanly: a server's normal end, not an interrupted
        # command (a second signal during the shutdown above still ends it as interrupted)
        note_interrupt(None)
    counts = queue.counts()
    _say(f"stopped: {_jobs(counts['done'])} done, {counts['failed']} failed, {counts['cancelled']} cancelled")


def _jobs(n: int) -> str:
    """`1 job`, `2 jobs`."""
    return f"{n} job{'' if n == 1 else 's'}"
