"""Issue 41's GPU evidence, through the product: calibrate a machine (its fits and their spreads), compare two
calibrations' constants against each other's bands, and gather run reports' verdicts against their plans' bands.

    python3 scripts/bands_evidence.py calibrate OUT.yaml RAW.json [--model wan2.2,flux]
    python3 scripts/bands_evidence.py compare A.yaml B.yaml OUT.json
    python3 scripts/bands_evidence.py verdicts OUT.json REPORT.json ...

`calibrate` is `chunkflow calibrate --model M --no-save` without the VAE decodes and the disk (chunkflow.commands.
calibrate.measure.calibrate(vaes=False, disk=False)): the held-out plans it feeds run the transformer's steps, which
those do not price, and they are most of calibrate's time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from chunkflow_planner.bands import Z  # noqa: E402
from chunkflow_planner.catalog import load_profile  # noqa: E402

# a fit's constants in the profile: (label, value) pairs
CONSTANTS = {
    "h2d": lambda hw: [("h2d_link_gbps", hw.h2d_link_gbps), ("dma_startup_us", hw.dma_startup_us)],
    "compute": lambda hw: [(f"eta {m} @ {f:.3g} FLOP", e) for m, c in hw.eta_comp_curves.items() for f, e in c],
    "cpu": lambda hw: [("cpu_tflops", hw.pipeline.cpu_tflops)],
    "codec_decode": lambda hw: [("codec_decode_gbps", hw.codec_decode_gbps)],
    "text_host": lambda hw: [(f"text_layer_host_us {a}", v) for a, v in hw.pipeline.text_layer_host_us.items()],
    "context": lambda hw: [("context_bytes", hw.context_bytes)],
    "process_host": lambda hw: [("process_host_bytes", hw.pipeline.process_host_bytes)],
}


def cmd_calibrate(a: argparse.Namespace) -> None:
    from chunkflow.commands.calibrate.measure import calibrate
    from chunkflow.commands.calibrate.profile import write_profile
    from chunkflow_planner.files import write_atomic

    t = time.perf_counter()
    cal = calibrate(a.model, vaes=False, disk=False, log=print, cpu_smoke=a.cpu_smoke)
    seconds = time.perf_counter() - t
    write_profile(cal.profile, a.out, f"measured by chunkflow calibrate --model {a.model} (no VAE decodes, no disk)")
    write_atomic(a.raw, json.dumps({**cal.raw, "seconds": seconds}, indent=2, default=str) + "\n")
    for name, q in sorted(cal.profile.fits.items()):
        print(f"fit {name}: {q.samples} samples, spread {q.spread:.2%}{' FLAGGED: ' + q.repeat if q.flagged else ''}")
    print(f"calibrated in {seconds:.1f} s")


def cmd_compare(a: argparse.Namespace) -> None:
    one, two = load_profile(Path(a.a)), load_profile(Path(a.b))
    rows = []
    for name in sorted(set(one.fits) & set(two.fits)):
        s1, s2 = one.fits[name].spread, two.fits[name].spread
        for (label, v1), (_, v2) in zip(*(CONSTANTS.get(name, lambda hw: [])(hw) for hw in (one, two))):
            if v1 is None or v2 is None or not v1:
                continue
            diff = v2 / v1 - 1
            rows.append(dict(fit=name, constant=label, first=v1, second=v2, diff=diff, band_first=Z * s1,
                             band_second=Z * s2, second_inside_first=abs(diff) <= Z * s1,
                             first_inside_second=abs(v1 / v2 - 1) <= Z * s2))
    fits = {n: dict(first=one.fits[n].model_dump(exclude={"residuals"}), second=two.fits[n].model_dump(
        exclude={"residuals"})) for n in sorted(set(one.fits) | set(two.fits)) if n in one.fits and n in two.fits}
    out = dict(rows=rows, fits=fits, inside=sum(r["second_inside_first"] and r["first_inside_second"] for r in rows),
               compared=len(rows))
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    for r in rows:
        print(f"{r['fit']:>12} {r['constant']:<42} {r['first']:.4g} -> {r['second']:.4g} ({r['diff']:+.2%}); bands "
              f"+-{r['band_first']:.2%} / +-{r['band_second']:.2%}: "
              f"{'inside' if r['second_inside_first'] and r['first_inside_second'] else 'OUTSIDE'}")
    print(f"{out['inside']} of {out['compared']} constants inside each other's bands")


def cmd_verdicts(a: argparse.Namespace) -> None:
    from chunkflow.reports import load_reports

    rows = []
    for path in a.reports:
        rep = load_reports([path])[0]
        w = rep.plan.workload
        for key, v in rep.bands.items():
            pred = rep.predicted.step_time_s if key == "step_time_s" else rep.predicted.peak_memory_bytes \
                if key == "peak_memory_bytes" else None
            rows.append(dict(report=Path(path).name, model=rep.plan.model.name,
                             workload=f"{w.width}x{w.height}x{w.frames} b{w.batch}", key=key, predicted=pred,
                             error=v.error, band=v.band, inside=v.inside, fits=v.fits))
    Path(a.out).write_text(json.dumps(dict(rows=rows, inside=sum(r["inside"] for r in rows), compared=len(rows)),
                                      indent=2) + "\n")
    for r in rows:
        print(f"{r['model']} {r['workload']} {r['key']}: {r['error']:+.2%} against +-{r['band']:.2%}: "
              f"{'inside' if r['inside'] else 'OUTSIDE'} ({', '.join(r['fits'])})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(required=True)
    c = sub.add_parser("calibrate")
    c.add_argument("out")
    c.add_argument("raw")
    c.add_argument("--model", default="wan2.2,flux")
    c.add_argument("--cpu-smoke", action="store_true", help="the tiny model on the CPU (to try the script)")
    c.set_defaults(fn=cmd_calibrate)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("out")
    c.set_defaults(fn=cmd_compare)
    c = sub.add_parser("verdicts")
    c.add_argument("out")
    c.add_argument("reports", nargs="+")
    c.set_defaults(fn=cmd_verdicts)
    a = p.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
