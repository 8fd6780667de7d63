"""/metrics: the queue's state and what its generations measured against the plan, in Prometheus' text format
(version 0.0.4)."""

from __future__ import annotations

import math

from chunkflow.serve.queue import FINISHED, RATIO_BUCKETS, STATES, JobQueue

__all__ = ["render_metrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _num(v: float | None) -> str:
    return "NaN" if v is None or not math.isfinite(v) else repr(float(v))


def render_metrics(queue: JobQueue) -> str:
    """Every metric of the queue, one family after another, each with its HELP and TYPE."""
    counts, s = queue.counts(), queue.stats
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[str, float | int | None]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {_num(v) if isinstance(v, float) or v is None else v}" for labels, v in samples)

    family("chunkflow_jobs", "gauge", "Jobs the server knows of, by state (finished ones as far back as its history "
           "goes).", [(f'{{state="{st}"}}', counts[st]) for st in STATES])
    family("chunkflow_jobs_finished_total", "counter", "Jobs finished since the server started, by state.",
           [(f'{{state="{st}"}}', s.finished[st]) for st in FINISHED])
    family("chunkflow_jobs_submitted_total", "counter", "Jobs accepted since the server started.",
           [("", s.submitted)])
    family("chunkflow_jobs_refused_total", "counter", "Jobs refused at submission (not fitting, malformed, queue "
           "full) since the server started.", [("", s.refused)])
    family("chunkflow_queue_length", "gauge", "Jobs waiting (not the running one).", [("", len(queue))])
    family("chunkflow_last_generation_seconds", "gauge", "The last finished generation's measured seconds.",
           [("", s.last_seconds)])
    family("chunkflow_last_generation_predicted_seconds", "gauge", "The plan's seconds for the last finished "
           "generation (NaN where the plan does not predict this device).", [("", s.last_predicted_s)])
    buckets = [(f'{{le="{edge}"}}', n) for edge, n in zip(RATIO_BUCKETS, s.ratio_buckets)]
    buckets.append(('{le="+Inf"}', s.ratio_count))
    lines.append("# HELP chunkflow_generation_time_ratio A generation's measured seconds over the plan's predicted "
                 "seconds (only where the plan predicts this device).")
    lines.append("# TYPE chunkflow_generation_time_ratio histogram")
    lines.extend(f"chunkflow_generation_time_ratio_bucket{labels} {n}" for labels, n in buckets)
    lines.append(f"chunkflow_generation_time_ratio_sum {_num(s.ratio_sum)}")
    lines.append(f"chunkflow_generation_time_ratio_count {s.ratio_count}")
    return "\n".join(lines) + "\n"
