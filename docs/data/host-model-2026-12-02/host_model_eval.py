"""The host model before and after issue 28's lean one, on every committed H200 generation report.

    .venv/bin/python docs/data/host-model-2026-12-02/host_model_eval.py > docs/data/host-model-2026-12-02/output.txt

Each report's plan is predicted again as it ran (its placements and offload: chunkflow.commands.calibrate.refit.generation_estimate)
twice: by the model of commit BASELINE (its src/ extracted from git into a temporary folder and run in a
subprocess) and by this checkout's, each on its own catalog entry `h200` (both refit from these reports) and on
the profile embedded in the report's plan (the one it ran with; this checkout reads the older ones through the
profile schema's migration; a profile neither can read is skipped, counted). Errors are measured / predicted - 1:
- generation: the measured generation (after --warmup: the median of the later ones) against the prediction
  without the start-ups (with them where the report ran no warm-up);
- first: the process's first generation (reports run with --warmup) against the prediction with the start-ups;
- encode: the encode phase alone, as generation.
Printed: median and worst |error| of each, over the reports, per model and profile; then what two pieces the lean
model kept pay (the start-ups per set of text encoders, the decoded output's three host copies), and per report.

The lean model (issue 28): a text encoder's forward takes the longer of its device time (ops.py, the GPU's measured
rates) and its host dispatch, its layers x its architecture's layer host time as calibrate times it
(`text_layer_host_us`) x `host_margin` (what generation reports show beyond it); on the CPU its matmuls at the
CPU's measured rates plus that dispatch. Gone: the operator counts (components.HOST_OPS, calibrate's counting, the
profile's text_host), the per-operator costs (host_op_us, cpu_op_us), the CPU's own dispatch timing.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

BASELINE = "605090e"  # the last commit with the per-operator host model (calibrate_host, HOST_OPS, text_host)
ROOT = Path(__file__).resolve().parents[3]
PHASES = ("encode", "denoise", "decode")


def report_paths() -> list[str]:
    """Every committed report holding a generation run on an H200."""
    out = []
    for path in sorted(glob.glob(str(ROOT / "docs/data/**/*-report.json"), recursive=True)):
        data = json.loads(Path(path).read_text())
        if data.get("generation") and "H200" in str(data.get("gpu", "")) + str(data["plan"]["hardware"]["name"]):
            out.append(path)
    return out


def predict_all(paths: list[str]) -> dict:
    """{profile kind: {report: {measured and predicted times}}} with the chunkflow on sys.path."""
    from chunkflow.commands.calibrate.refit import generation_estimate
    from chunkflow.reports import load_reports
    from chunkflow_planner.catalog import HardwareSpec, get_hardware

    out: dict = {"catalog": {}, "embedded": {}, "unread": {}}
    for path in paths:
        rep = load_reports([path])[0]
        g = rep.generation
        warm = bool(g.warmup_generations)
        rel = os.path.relpath(path, ROOT)
        measured = dict(generation=g.generation_time_s, encode=g.phases["encode"].measured_time_s,
                        first=sum(g.first_phase_times_s.values()) if warm and g.first_phase_times_s else None,
                        first_encode=(g.first_phase_times_s or {}).get("encode") if warm else None)
        try:
            embedded = HardwareSpec(**rep.plan.hardware.spec)
        except (TypeError, ValueError) as exc:
            embedded = None
            out["unread"][rel] = " ".join(str(exc).splitlines()[:2])[:200]
        for kind, hw in (("catalog", get_hardware("h200")), ("embedded", embedded)):
            if hw is None:
                continue
            e, _ = generation_estimate(rep, hw)
            ph = e.phases
            later = {n: ph[n].time_s - (ph[n].startup_s if warm else 0.0) for n in PHASES}
            out[kind][rel] = dict(measured=measured, generation=sum(later.values()), encode=later["encode"],
                                  first=e.generation_time, first_encode=ph["encode"].time_s)
    return out


def ablations(paths: list[str]) -> list[str]:
    """What two pieces of this checkout's model pay, on its catalog h200: the start-ups per set of text encoders
    (`startup_s` keys `encode:<archs>`) against the encode phase's one, on the first generations; the decoded
    output's host copies (pipeline.OUTPUT_HOST_COPIES) against one copy, on the peak host memory, process_host_bytes
    refit for each (calibrate.refit_load, as `calibrate --from-report` does)."""
    import chunkflow_planner.pipeline.decode as pipeline  # where output_host_bytes reads OUTPUT_HOST_COPIES
    from chunkflow.commands.calibrate.refit import generation_estimate, refit_load
    from chunkflow.reports import load_reports
    from chunkflow_planner.catalog import get_hardware

    reps = [load_reports([p])[0] for p in paths]
    hw = get_hardware("h200")
    out = []
    plain = hw.model_copy(update={"startup_s": {k: v for k, v in hw.pipeline.startup_s.items() if ":" not in k}})
    for name, h in (("per set of text encoders", hw), ("the encode phase's one only", plain)):
        errs = [sum(r.generation.first_phase_times_s.values()) / generation_estimate(r, h)[0].generation_time - 1
                for r in reps if r.generation.warmup_generations and r.generation.first_phase_times_s]
        enc = [r.generation.first_phase_times_s["encode"] / generation_estimate(r, h)[0].phases["encode"].time_s - 1
               for r in reps if r.generation.warmup_generations and r.generation.first_phase_times_s]
        out.append(f"| encode start-up {name} | {len(errs)} first generations | {_stat(errs)} | first encode "
                   f"{_stat(enc)} |")
    kept = pipeline.OUTPUT_HOST_COPIES
    try:
        for copies in (kept, 1):
            pipeline.OUTPUT_HOST_COPIES = copies
            h = hw.model_copy(update=refit_load(hw, reps))
            errs = [r.generation.host_peak_bytes / generation_estimate(r, h)[0].host_memory - 1 for r in reps]
            out.append(f"| output host copies {copies} (process_host_bytes refit: {h.pipeline.process_host_bytes / 1e9:.2f} GB) "
                       f"| {len(errs)} reports | peak host memory {_stat(errs)} | |")
    finally:
        pipeline.OUTPUT_HOST_COPIES = kept
    return out


def _baseline_predictions(paths: list[str]) -> dict:
    """predict_all run by the model of BASELINE: its src/ from git, this script's predict_all in a subprocess."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", BASELINE, "src", "hardware.yaml",
                                  "models.yaml"], check=True,
                                 capture_output=True).stdout
        tar_path = Path(tmp) / "src.tar"
        tar_path.write_bytes(archive)
        with tarfile.open(tar_path) as tar:
            tar.extractall(tmp, filter="data")
        env = dict(os.environ, PYTHONPATH=str(Path(tmp) / "src"))
        code = (f"import json, sys; sys.path.insert(0, {str(Path(tmp) / 'src')!r}); "
                f"sys.path.insert(1, {str(Path(__file__).parent)!r}); import host_model_eval as m; "
                f"print(json.dumps(m.predict_all(json.loads(sys.stdin.read()))))")
        p = subprocess.run([sys.executable, "-c", code], input=json.dumps(paths), capture_output=True, text=True,
                           env=env, cwd=tmp, check=False)
        if p.returncode:
            raise SystemExit(f"the baseline's predictions failed:\n{p.stderr[-4000:]}")
        return json.loads(p.stdout)


def _errors(rows: dict, what: str) -> list[float]:
    return [r["measured"][what] / r[what] - 1 for r in rows.values() if r["measured"][what] is not None]


def _stat(errs: list[float]) -> str:
    if not errs:
        return "-"
    a = [abs(x) for x in errs]
    return f"{statistics.median(a):.2%} / {max(a):.2%}"


def main() -> None:
    paths = report_paths()
    print(f"{len(paths)} generation reports on an H200 (docs/data):")
    for p in paths:
        print(f"  {os.path.relpath(p, ROOT)}")
    models = {f"baseline {BASELINE}": _baseline_predictions(paths), "lean (this checkout)": predict_all(paths)}
    print()
    print("median / worst |measured / predicted - 1|")
    print("| model | profile | reports | generation | first generation | encode | first encode |")
    print("|---|---|---|---|---|---|---|")
    for name, preds in models.items():
        for kind in ("catalog", "embedded"):
            rows = preds[kind]
            firsts = [v for v in rows.values() if v["measured"]["first"] is not None]
            print(f"| {name} | {'h200 of its catalog' if kind == 'catalog' else 'the one each ran with'} | "
                  f"{len(rows)} ({len(firsts)} with a first) | {_stat(_errors(rows, 'generation'))} | "
                  f"{_stat(_errors(rows, 'first'))} | {_stat(_errors(rows, 'encode'))} | "
                  f"{_stat(_errors(rows, 'first_encode'))} |")
    for name, preds in models.items():
        for rel, why in preds["unread"].items():
            print(f"- {name}: embedded profile of {rel} not read: {why}")
    print()
    print("what two pieces pay (this checkout, its catalog h200): median / worst |measured / predicted - 1|")
    print("| variant | over | error | |")
    print("|---|---|---|---|")
    print("\n".join(ablations(paths)))
    print()
    print("per report, on each model's catalog h200: generation error baseline -> lean (encode error baseline -> lean)")
    base, lean = (m["catalog"] for m in models.values())
    for rel in base:
        b, n = base[rel], lean[rel]
        gen = [r["measured"]["generation"] / r["generation"] - 1 for r in (b, n)]
        enc = [r["measured"]["encode"] / r["encode"] - 1 for r in (b, n)]
        print(f"  {rel}: {gen[0]:+.2%} -> {gen[1]:+.2%} ({enc[0]:+.1%} -> {enc[1]:+.1%}; "
              f"predicted encode {b['encode'] * 1e3:.0f} -> {n['encode'] * 1e3:.0f} ms, measured "
              f"{b['measured']['encode'] * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
