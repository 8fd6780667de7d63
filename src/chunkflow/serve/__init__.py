"""`chunkflow serve`: one loaded pipeline behind a local HTTP API (a job queue, its worker, a small page).

queue.JobQueue owns the Session and its worker thread; app.make_app puts the HTTP API over a queue; page and
metrics render what the API serves. FastAPI and uvicorn are imported inside this package only (the `serve`
extra)."""

from __future__ import annotations

from chunkflow_planner.errors import ChunkflowError

__all__ = ["ServeExtrasMissing", "require_serve_extras"]


class ServeExtrasMissing(ChunkflowError):
    """FastAPI or uvicorn not installed."""


def require_serve_extras() -> None:
    """Raise ServeExtrasMissing (what to install) unless FastAPI and uvicorn can be imported."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise ServeExtrasMissing(f"`chunkflow serve` needs {' and '.join(missing)}: "
                                 "pip install 'chunkflow-dit[serve]'")
