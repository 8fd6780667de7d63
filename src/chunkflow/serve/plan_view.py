"""GET /plan: what the page shows of the plan the server loaded, as JSON. The form (the fields the loaded pipeline
takes, their defaults from the plan, the steps a size or frame count must keep), where each component runs and the
memory it holds, each phase's predicted time and peak, and whether the plan predicts this device at all (a CPU
plan's times are nominal, not predictions: the queue then predicts no start or finish and the page says so).
Numbers come raw (bytes, seconds) and as the CLI writes them (units.format_bytes, format_seconds)."""

from __future__ import annotations

from chunkflow_planner.pipeline.jobs import MAX_PROMPT_CHARS
from chunkflow_planner.units import format_bytes, format_seconds
from chunkflow_planner.workload import MAX_STEPS

__all__ = ["plan_view", "prediction_note"]

# placement -> (runs on, where its weights are held); a device that is the host says "device (the CPU)"
_WHERE = {
    "gpu": ("{dev}", "{dev} memory, throughout"),
    "phase": ("{dev}", "host memory, on the {dev} for its phase only"),
    "stream": ("{dev}", "host memory, streamed to the {dev} by chunkflow"),
    "cpu": ("CPU", "host memory"),
    "disk": ("{dev}", "disk: the checkpoint's files, read at its phase"),
}


def prediction_note(session) -> str | None:
    """Why the queue predicts no start or finish here (None where it does): a CPU plan's times are nominal, a plan
    for another kind of device than the one run on, a plan without a pipeline section."""
    plan = session.plan
    if plan.pipeline is None:
        return "No prediction: the plan has no pipeline section (planned --transformer-only)"
    if session.comparable:
        return None
    if plan.hardware.device_is_host or session.device.type != "cuda":
        return ("No prediction: on a CPU the plan's times are nominal figures, not predictions (plan for a GPU and "
                "serve on it to have them)")
    return f"No prediction: the plan is for {plan.hardware.name}, not the {session.device.type} this server runs on"


def _form(session, max_body_bytes: int) -> dict:
    """The fields the loaded pipeline takes, their defaults from the plan, and the limits the API checks."""
    from chunkflow.models.adapters import negative_prompt_refusal

    plan, spec = session.plan, session.spec
    w = plan.workload
    refusal = negative_prompt_refusal(spec) if spec.pipeline is not None else "the plan has no pipeline"
    guidance = spec.pipeline.guidance if spec.pipeline is not None else None
    return {
        "video": bool(spec.is_video), "image": bool(getattr(session, "image", False)),
        "negative_prompt": refusal is None, "negative_prompt_refusal": refusal,
        "defaults": {"seed": 0, "steps": w.steps, "width": w.width, "height": w.height,
                     "frames": w.frames if spec.is_video else None, "guidance": guidance},
        "limits": {"height_step": spec.vae_spatial * spec.patch[1], "width_step": spec.vae_spatial * spec.patch[2],
                   "frames_step": spec.vae_temporal if spec.is_video else None, "max_steps": MAX_STEPS,
                   "max_prompt_chars": MAX_PROMPT_CHARS, "max_body_bytes": max_body_bytes},
    }


def _components(plan) -> list[dict]:
    """Each component: where it runs, where its weights are held, the host memory and disk reads the plan gives
    it."""
    dev = "device (the CPU)" if plan.hardware.device_is_host else "GPU"
    host = plan.prediction.host_memory or {}
    out = []
    for c in plan.pipeline.components:
        runs_on, held_in = (s.format(dev=dev) for s in _WHERE[c.placement])
        if c.kind == "vae" and plan.pipeline.vae_tiling:
            runs_on += ", tiled decode"
        if c.steps is not None:
            runs_on += f"; {c.steps} of {plan.workload.steps} steps"
        host_bytes = host.get(c.name)
        out.append({"name": c.name, "kind": c.kind, "placement": c.placement, "runs_on": runs_on,
                    "held_in": held_in, "bytes": c.bytes, "bytes_text": format_bytes(c.bytes),
                    "host_bytes": host_bytes, "host_text": format_bytes(host_bytes) if host_bytes else None,
                    "disk_read_bytes": c.disk_read_bytes,
                    "disk_read_text": format_bytes(c.disk_read_bytes) if c.disk_read_bytes else None})
    return out


def _seconds(value: float | None) -> dict:
    return {"s": value, "text": None if value is None else format_seconds(value)}


def _bytes(value: int | None) -> dict:
    return {"bytes": value, "text": None if value is None else format_bytes(value)}


def _prediction(plan) -> dict:
    """The plan's step and generation times, each phase's time and peak device memory, host memory and budgets."""
    pp = plan.prediction
    phases = [] if pp.phases is None else [
        {"name": n, "time": _seconds(getattr(pp.phases, n).time_s),
         "peak_memory": _bytes(getattr(pp.phases, n).peak_memory_bytes)} for n in ("encode", "denoise", "decode")]
    startup = 0.0 if pp.phases is None else sum(getattr(pp.phases, n).startup_s for n in ("encode", "denoise", "decode"))
    return {"step_time": _seconds(pp.step_time_s), "generation_time": _seconds(pp.generation_time_s),
            "startup": _seconds(startup or None), "phases": phases,
            "host_memory": _bytes(pp.host_memory_bytes), "host_budget": _bytes(plan.host_memory_budget_bytes),
            "device_budget": _bytes(plan.memory_budget_bytes), "device_word": plan.hardware.device_word}


def plan_view(session, max_body_bytes: int) -> dict:
    """The loaded plan as the page shows it (module docstring)."""
    plan = session.plan
    return {
        "model": session.spec.name, "device": str(session.device), "hardware": plan.hardware.name,
        "offload": session.cfg.label, "sp_degree": plan.parallel.sp_degree,
        "workload": {"width": plan.workload.width, "height": plan.workload.height, "frames": plan.workload.frames,
                     "steps": plan.workload.steps},
        "predicts": prediction_note(session) is None, "prediction_note": prediction_note(session),
        "nominal": bool(plan.hardware.device_is_host),
        "form": _form(session, max_body_bytes),
        "components": [] if plan.pipeline is None else _components(plan),
        "prediction": _prediction(plan),
    }
