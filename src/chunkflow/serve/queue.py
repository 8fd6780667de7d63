"""The server's job queue: one loaded Session, one worker thread taking jobs in order, each job's state and the
plan's prediction of when it starts and finishes.

A job is checked when it is submitted (its fields, whether it fits the loaded placement: the planner's reason if
not, whether the queue has room), never when the worker reaches it. Outputs go to the queue's output folder, named
by the job's id only (`<id>.mp4`, `<id>.png`): nothing a request says becomes a path. A generation that raises
marks its job failed with the message and the worker goes on; a cancelled running job stops after its current
denoising step. A step cache is the session's (`serve --cache`, or the plan's): every job runs with it, its state
reset before each (a cancelled job's left behind included), and a job's snapshot says what it skipped (`cache`).
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.pipeline.jobs import Job, JobError

__all__ = ["JobQueue", "QueuedJob", "QueueFull", "QueueClosed", "UnknownJob", "STATES", "DEFAULT_MAX_QUEUE"]

STATES = ("queued", "running", "done", "failed", "cancelled")
FINISHED = ("done", "failed", "cancelled")
DEFAULT_MAX_QUEUE = 64
# the image files the queued jobs hold, together (each is checked from its header, at most the app's body limit): 64
# jobs of ~24 MB would keep 1.5 GB of a 32 GB desktop's memory from the model; a job over it waits for room
DEFAULT_MAX_IMAGE_BYTES = 256 * 2**20
DEFAULT_HISTORY = 256
RATIO_BUCKETS = (0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0)  # measured / predicted


class QueueFull(JobError):
    """The queue holds max_queue jobs already, or its jobs' images max_image_bytes."""


class QueueClosed(ChunkflowError):
    """The queue is shutting down: it takes no more jobs."""


class UnknownJob(ChunkflowError):
    """No job of that id (never submitted, or gone from the history)."""


class _Cancelled(Exception):
    """Raised from on_step to stop a running job that was cancelled (private: never leaves the worker)."""


@dataclass
class QueuedJob:
    """One job of the queue and everything the server says about it."""

    id: str
    job: Job
    image: bytes | None  # the image file's bytes as uploaded (checked, not decoded: a queued job holds what it
    #                      was sent, not its pixels), or None; decoded when the job runs, dropped once it is finished
    submitted: float  # time.time()
    predicted_first_s: float | None  # the plan's seconds as the session's first generation
    predicted_later_s: float | None  # ... as a later one
    state: str = "queued"
    started: float | None = None
    finished: float | None = None
    seconds: float | None = None  # the generation's measured seconds
    predicted_s: float | None = None  # the plan's seconds for it as it ran
    error: str | None = None
    output: str | None = None  # the output's file name in the queue's folder
    step: int = 0
    steps: int | None = None
    phase: str | None = None  # while running: encode, denoise, decode, then write (its output saved)
    settings: dict = field(default_factory=dict)  # what it runs with, the plan's defaults filled in (settings())
    cache: dict | None = None  # a done job's step cache: what it skipped (reports.CacheResult as JSON)
    cancel_requested: bool = False

    def predicted(self, first: bool) -> float | None:
        return self.predicted_first_s if first else self.predicted_later_s


def chain_times(now: float | None, running: tuple[float | None, float | None] | None,
                predicted: list[float | None], after_s: float) -> list[tuple[float | None, float | None]]:
    """(start, finish) of each queued job, in order: the first starts when the running job (its start and
    predicted seconds) is predicted to be over, its output written `after_s` after its generation, or now if none
    runs or it overran; each next one when the one before is predicted to be over. A finish is when the result is
    there (generation and output). None from the first unknown on (a queue paused, `now` None; a job the plan does
    not predict)."""
    ahead = now
    if running is not None and ahead is not None:
        started, seconds = running
        ahead = None if started is None or seconds is None else max(now, started + seconds + after_s)
    out: list[tuple[float | None, float | None]] = []
    for p in predicted:
        start = ahead
        finish = None if start is None or p is None else start + p + after_s
        out.append((start if finish is not None else None, finish))
        ahead = finish
    return out


def settings(job: Job, workload, spec, cache: str | None = None) -> dict:
    """What a job runs with, the plan's defaults filled in: its seed (as decimal text: a browser's JSON reader holds
    integers to 2**53 only), steps, size, frames (a video model's), guidance (the pipeline's default where the job
    gives none), negative prompt and the server's step cache (`serve --cache`, as it takes it back; None: none)."""
    pipeline = getattr(spec, "pipeline", None)
    guidance = job.guidance if job.guidance is not None else getattr(pipeline, "guidance", None)
    return {"seed": str(job.seed), "steps": workload.steps, "width": workload.width, "height": workload.height,
            "frames": workload.frames if spec.is_video else None, "guidance": guidance,
            "negative_prompt": job.negative_prompt, "cache": cache}


def cache_label_of(session) -> str | None:
    """The session's step cache as `--cache` takes it, None without one."""
    from chunkflow_planner.cache import cache_label

    setting = getattr(session, "cache", None)
    return cache_label(setting) if setting is not None else None


def progress(qj: QueuedJob) -> float | None:
    """How far a job is, 0 to 1: a running job by its denoising steps done (the step callback), a done job 1,
    otherwise None (queued, or finished without a result)."""
    if qj.state == "done":
        return 1.0
    if qj.state != "running" or not qj.steps:
        return 0.0 if qj.state == "running" else None
    return min(1.0, qj.step / qj.steps)


@dataclass
class Stats:
    """What the queue has done since it started (for /metrics): jobs finished by state, the last generation's
    measured and predicted seconds, and the measured / predicted ratios as a histogram."""

    finished: dict[str, int] = field(default_factory=lambda: {s: 0 for s in FINISHED})
    submitted: int = 0
    refused: int = 0
    last_seconds: float | None = None
    last_predicted_s: float | None = None
    ratio_buckets: list[int] = field(default_factory=lambda: [0] * len(RATIO_BUCKETS))
    ratio_count: int = 0
    ratio_sum: float = 0.0

    def observe(self, seconds: float, predicted: float | None) -> None:
        self.last_seconds, self.last_predicted_s = seconds, predicted
        if predicted:
            ratio = seconds / predicted
            self.ratio_count += 1
            self.ratio_sum += ratio
            for i, edge in enumerate(RATIO_BUCKETS):
                if ratio <= edge:
                    self.ratio_buckets[i] += 1


class JobQueue:
    """Jobs for one Session, run one at a time by a worker thread (module docstring). `observer(id, i, n)`, if
    given, hears of each denoising step in the worker thread (after the queue has noted it)."""

    def __init__(self, session, out_dir: str | Path, *, max_queue: int = DEFAULT_MAX_QUEUE,
                 history: int = DEFAULT_HISTORY, observer: Callable[[str, int, int], None] | None = None,
                 paused: bool = False, max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> None:
        if max_queue < 1:
            raise ChunkflowError(f"max_queue must be at least 1, got {max_queue}")
        self.session = session
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_queue = max_queue
        self.max_image_bytes = max_image_bytes
        self.stats = Stats()
        self._observer = observer
        self._cond = threading.Condition()
        self._queue: deque[QueuedJob] = deque()
        self._history: deque[QueuedJob] = deque()
        self._history_max = max(1, history)
        self._after: deque[float] = deque(maxlen=8)  # seconds the last jobs done spent beyond their generation
        self._jobs: dict[str, QueuedJob] = {}
        self._running: QueuedJob | None = None
        self._paused = paused
        self._closing = False
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="chunkflow-serve-worker", daemon=True)
        self._worker.start()

    # -- submitting and cancelling ---------------------------------------------------------------------------
    def submit(self, job: Job, image: bytes | None = None) -> dict:
        """Queue `job` (with an image file's bytes for an image pipeline, checked from its header by the caller:
        media.check_input_image_bytes; decoded when the job runs); its snapshot. Raises JobError (what is wrong,
        the planner's reason where it does not fit), QueueFull, QueueClosed, at once."""
        if image is not None and not isinstance(image, bytes):
            raise TypeError("JobQueue.submit takes the image file's bytes, not a decoded image")
        if self._closing:
            raise QueueClosed("the server is shutting down; it takes no more jobs")
        try:
            fit = self._check(job, image)
        except JobError:
            with self._cond:
                self.stats.refused += 1
            raise
        first = self.session.predicted_s(job, first=True)  # None where the plan does not predict this device
        later = self.session.predicted_s(job, first=False) if first is not None else None
        with self._cond:
            if self._closing:
                raise QueueClosed("the server is shutting down; it takes no more jobs")
            if len(self._queue) >= self.max_queue:
                self.stats.refused += 1
                raise QueueFull(f"the queue holds {len(self._queue)} jobs already (at most {self.max_queue}); "
                                "submit again when some have finished")
            held = self._image_bytes()
            if image is not None and held + len(image) > self.max_image_bytes:
                self.stats.refused += 1
                raise QueueFull(f"the queued jobs' images hold {held:,} bytes already, and this one's {len(image):,} "
                                f"would pass {self.max_image_bytes:,}; submit again when some have finished")
            qj = QueuedJob(uuid.uuid4().hex, job, image, time.time(), first, later,
                           settings=settings(job, fit.workload, self.session.spec, cache_label_of(self.session)))
            self._queue.append(qj)
            self._jobs[qj.id] = qj
            self.stats.submitted += 1
            self._cond.notify_all()
            return self._snapshots()[qj.id]

    def _image_bytes(self) -> int:
        """Bytes of the image files the queued and the running jobs hold (the caller holds the lock)."""
        jobs = list(self._queue) + ([self._running] if self._running is not None else [])
        return sum(len(qj.image) for qj in jobs if qj.image is not None)

    def _check(self, job: Job, image: bytes | None):  # noqa: ANN202 - planner.pipeline.jobs.JobFit
        """Whatever would make the job fail that can be known now: a path from the request, an image the
        pipeline does not take or needs, a negative prompt it does not use, a shape that does not fit."""
        if job.image is not None:
            raise JobError("the server takes no image path; send the image itself (image_base64: a base64 PNG, "
                           "JPEG or WebP)")
        if job.out is not None:
            raise JobError("the server names each output by its job id; leave out \"out\" (fetch the result from "
                           "/jobs/<id>/result)")
        if image is None and getattr(self.session, "image", False):
            raise JobError("this server's pipeline animates or edits an image: send one (image_base64: a base64 PNG, "
                           "JPEG or WebP)")
        fit = self.session.fit(job, with_image=image is not None)  # its shape, an image, a negative prompt
        if fit.reason is not None:
            raise JobError(fit.reason)
        return fit

    def cancel(self, job_id: str) -> dict:
        """Cancel a job: a queued one leaves the queue, a running one stops after its current denoising step (its
        snapshot then says running until it has). A finished job is left as it is. UnknownJob if no such id."""
        with self._cond:
            qj = self._get(job_id)
            if qj.state == "queued":
                self._queue.remove(qj)
                self._finish(qj, "cancelled")
            elif qj.state == "running":
                qj.cancel_requested = True
            return self._snapshots()[qj.id]

    # -- the worker ------------------------------------------------------------------------------------------
    def pause(self) -> None:
        """Take no new job from the queue (a running one goes on) until resume()."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._closing and (self._paused or not self._queue):
                    self._cond.wait()
                if self._closing:
                    return
                qj = self._queue.popleft()
                qj.state, qj.started = "running", time.time()
                qj.predicted_s = qj.predicted(self.session.generations == 0)
                self._running = qj
            self._run(qj)

    def _run(self, qj: QueuedJob) -> None:
        def on_step(i: int, n: int) -> None:
            qj.step, qj.steps, qj.phase = i, n, "denoise"
            if self._observer is not None:
                self._observer(qj.id, i, n)
            if qj.cancel_requested:
                raise _Cancelled

        def on_phase(name: str) -> None:
            qj.phase = name

        from chunkflow.media import load_input_image_bytes

        state, error, result = "done", None, None
        try:
            image = None if qj.image is None else load_input_image_bytes(qj.image, "image_base64")
            qj.phase = "encode"
            result = self.session.generate(qj.job, image=image, on_step=on_step, on_phase=on_phase)
            qj.phase = "write"
            saved = result.save(self.out_dir / f"{qj.id}{'.mp4' if result.is_video else '.png'}")
            qj.output = saved.name
            self._after.append(max(0.0, time.time() - qj.started - result.seconds))
        except _Cancelled:
            state = "cancelled"
        except ChunkflowError as exc:
            state, error = "failed", str(exc)
        except Exception as exc:  # anything else the generation raised: this job failed, the server goes on
            state, error = "failed", f"{type(exc).__name__}: {exc}"
        with self._cond:
            if state == "done" and qj.cancel_requested and qj.output is None:
                state = "cancelled"
            if result is not None:
                qj.seconds = result.seconds
                skipped = getattr(result, "cache", None)  # (a session's Result; a stand-in may have none)
                qj.cache = skipped.model_dump(mode="json") if skipped is not None else None
                if state == "done":
                    self.stats.observe(result.seconds, result.predicted_s)
            qj.error = error
            self._running = None
            self._finish(qj, state)

    def _finish(self, qj: QueuedJob, state: str) -> None:
        """`qj` is over (the condition held): into the bounded history, the oldest forgotten (its file stays)."""
        qj.state, qj.finished, qj.image, qj.phase = state, time.time(), None, None
        self.stats.finished[state] += 1
        self._history.append(qj)
        while len(self._history) > self._history_max:
            old = self._history.popleft()
            self._jobs.pop(old.id, None)
        self._cond.notify_all()

    # -- what the server says --------------------------------------------------------------------------------
    def _get(self, job_id: str) -> QueuedJob:
        qj = self._jobs.get(job_id)
        if qj is None:
            raise UnknownJob(f"no job {job_id!r} (never submitted, or finished long enough ago to be forgotten)")
        return qj

    def get(self, job_id: str) -> dict:
        """One job's snapshot (UnknownJob if no such id)."""
        with self._cond:
            self._get(job_id)
            return self._snapshots()[job_id]

    def output_path(self, job_id: str) -> tuple[str, Path | None]:
        """A job's state and, when it is done, its output file (in the queue's folder, named by its id)."""
        with self._cond:
            qj = self._get(job_id)
            return qj.state, (self.out_dir / qj.output) if qj.state == "done" and qj.output else None

    def jobs(self) -> list[dict]:
        """The running job, the queued ones in order, then the finished ones, the newest first."""
        with self._cond:
            snaps = self._snapshots()
            order = ([self._running] if self._running else []) + list(self._queue) + list(reversed(self._history))
            return [snaps[q.id] for q in order]

    def counts(self) -> dict[str, int]:
        """Jobs the queue knows of by state (finished ones as far back as its history goes)."""
        with self._cond:
            out = {s: 0 for s in STATES}
            for qj in self._jobs.values():
                out[qj.state] += 1
            return out

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)

    def _snapshots(self) -> dict[str, dict]:
        """Every known job as the API shows it (the condition held), with the predicted start and finish of the
        running and queued ones (chain_times): the running job's predicted remaining from its start, then each
        queued job's predicted seconds in turn, each with the time a job here spends beyond its generation (its
        output written: `after_s`, measured on the jobs done); None from the first job the plan does not predict."""
        first = self.session.generations == 0
        out: dict[str, dict] = {}
        running = None
        if self._running is not None:
            r = self._running
            out[r.id] = self._snapshot(r, after_s=self.after_s)
            running = (r.started, r.predicted_s)
            first = False
        predicted = []
        for qj in self._queue:
            predicted.append(qj.predicted(first))
            first = False
        times = chain_times(None if self._paused else time.time(), running, predicted, self.after_s)
        for pos, (qj, p, (start, finish)) in enumerate(zip(self._queue, predicted, times)):
            out[qj.id] = self._snapshot(qj, pos, start, finish, p)
        for qj in self._history:
            out[qj.id] = self._snapshot(qj)
        return out

    @property
    def after_s(self) -> float:
        """Seconds a job spends beyond its generation (writing its output), the median of the last jobs done; 0
        before the first."""
        return statistics.median(self._after) if self._after else 0.0

    @staticmethod
    def _snapshot(qj: QueuedJob, position: int | None = None, start: float | None = None,
                  finish: float | None = None, predicted: float | None = None, after_s: float = 0.0) -> dict:
        """A job as the API shows it; a queued job's predicted start, finish and seconds as given (None where not
        predicted), the others' from their start and the plan's seconds."""
        j = qj.job
        if qj.state != "queued":
            predicted = qj.predicted_s
            start = qj.started
            finish = None if start is None or predicted is None else start + predicted + after_s
        return {
            "id": qj.id, "state": qj.state, "position": position,
            "prompt": j.prompt, "negative_prompt": j.negative_prompt, "seed": j.seed, "guidance": j.guidance,
            "steps": j.steps, "height": j.height, "width": j.width, "frames": j.frames,
            "submitted": qj.submitted, "started": qj.started, "finished": qj.finished,
            "predicted_start": start, "predicted_finish": finish, "predicted_s": predicted,
            "seconds": qj.seconds, "step": qj.step, "steps_total": qj.steps, "phase": qj.phase,
            "progress": progress(qj), "settings": qj.settings, "cache": qj.cache,
            "cancel_requested": qj.cancel_requested, "error": qj.error, "output": qj.output,
            "result_url": f"/jobs/{qj.id}/result" if qj.state == "done" and qj.output else None,
        }

    # -- shutting down ---------------------------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None) -> None:
        """Take no more jobs, cancel the queued ones and the running one (it stops after its current step), wait
        for the worker, close the session. A second call does nothing."""
        with self._cond:
            if self._closed:
                return
            self._closing = True
            while self._queue:
                self._finish(self._queue.popleft(), "cancelled")
            if self._running is not None:
                self._running.cancel_requested = True
            self._cond.notify_all()
        self._worker.join(timeout)
        with self._cond:
            self._closed = True
        self.session.close()

    @property
    def closed(self) -> bool:
        return self._closed
