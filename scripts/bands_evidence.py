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

from chunkflow_planner.bands import FITS, Z, drift_between, spread_of  # noqa: E402
from chunkflow_planner.catalog import load_profile  # noqa: E402

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
    """Each fit's figures (bands.FITS values) of two calibrations: the second against the first's band as a plan
    made from the first uses it (Z x spread_of: the samples' spread and the drift, measured or the prior), and
    against the samples' spread alone (what the band was before drift)."""
    one, two = load_profile(Path(a.a)), load_profile(Path(a.b))
    rows = []
    for name in sorted(set(one.fits) & set(two.fits)):
        band = Z * spread_of(one, name)[0]
        within = Z * one.fits[name].spread
        was = dict(FITS[name].values(one))
        for label, v2 in FITS[name].values(two):
            v1 = was.get(label)
            if not v1:
                continue
            diff = v2 / v1 - 1
            rows.append(dict(fit=name, constant=label, first=v1, second=v2, diff=diff, band_first=band,
                             drift_first=one.fits[name].drift, band_within_first=within, inside=abs(diff) <= band,
                             inside_within=abs(diff) <= within))
    fits = {n: dict(first=one.fits[n].model_dump(exclude={"residuals"}), second=two.fits[n].model_dump(
        exclude={"residuals"})) for n in sorted(set(one.fits) & set(two.fits))}
    out = dict(rows=rows, fits=fits, drift=drift_between(one, two), inside=sum(r["inside"] for r in rows),
               inside_within=sum(r["inside_within"] for r in rows), compared=len(rows))
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    for r in rows:
        print(f"{r['fit']:>12} {r['constant']:<42} {r['first']:.4g} -> {r['second']:.4g} ({r['diff']:+.2%}); band "
              f"+-{r['band_first']:.2%} (samples alone +-{r['band_within_first']:.2%}): "
              f"{'inside' if r['inside'] else 'OUTSIDE'}")
    print("moved (root mean square by fit): " + ", ".join(f"{n} {d:.2%}" for n, d in out["drift"].items()))
    print(f"{out['inside']} of {out['compared']} figures of the second inside the first's bands "
          f"({out['inside_within']} inside the samples' spread alone)")


def cmd_verdicts(a: argparse.Namespace) -> None:
    from chunkflow.reports import load_reports

    rows = []
    for path in a.reports:
        rep = load_reports([path])[0]
        w = rep.plan.workload
        for key, v in rep.bands.items():
            pred = rep.plan.prediction.model_dump()
            for part in key.split("."):
                pred = pred.get(part) if isinstance(pred, dict) else None
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
