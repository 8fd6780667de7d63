"""The decode phases of earlier generation reports priced again on another profile, everything the runs' plans
decided held (their placements, offload and tiling): the decode's allocation and peak against what the runs measured.
It sets a calibration's decode fits (a derived VAE's too, where `calibrate --weights` timed it) beside decodes that
ran before it, on the same kind of GPU.

    python3 docs/data/gpu-firstgen/reprice_decode.py run-5/profile.yaml run-4/report-*.json --out decode.json
"""

from __future__ import annotations

import argparse
import json


def _row(report, hw, label: str) -> dict:
    from chunkflow.commands.calibrate.refit import generation_estimate

    e, _ = generation_estimate(report, hw)
    ph = report.generation.phases["decode"]
    peak, alloc = e.peak_memory("decode"), e.phases["decode"].allocated_bytes
    return dict(profile=label, vae=report.plan.model.spec.pipeline.vae.name,
                predicted_peak_bytes=int(peak), measured_peak_bytes=ph.measured_peak_memory_bytes,
                peak_error=ph.measured_peak_memory_bytes / peak - 1,
                predicted_allocated_bytes=int(alloc), measured_allocated_bytes=ph.measured_peak_allocated_bytes,
                allocated_error=ph.measured_peak_allocated_bytes / alloc - 1,
                alloc_slack=e.phases["decode"].alloc_slack)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", help="the profile to price with")
    ap.add_argument("reports", nargs="+", help="generation reports (chunkflow run --report)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from chunkflow.commands.calibrate.refit import read_reports
    from chunkflow_planner.catalog import load_profile
    from chunkflow_planner.plan import hardware_of

    hw = load_profile(args.profile)
    rows = []
    for path, report in zip(args.reports, read_reports(args.reports)):
        for label, prof in (("the run's plan", hardware_of(report.plan)), (args.profile, hw)):
            rows.append(dict(report=path, **_row(report, prof, label)))
            r = rows[-1]
            print(f"{path}: {label}: decode peak {r['predicted_peak_bytes'] / 1e9:.3f} GB predicted, "
                  f"{r['measured_peak_bytes'] / 1e9:.3f} GB measured ({r['peak_error']:+.1%}); allocated "
                  f"{r['allocated_error']:+.1%}; slack {r['alloc_slack']}")
    with open(args.out, "w") as f:
        json.dump(dict(profile=args.profile, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
