"""The GPU runs' plans made again with attention priced at each model's head dim (the profile they were planned
with plus calibrate's head-dim-64 table measured in the same session): the same model (the plan file's embedded
entry), workload and budgets; the step time each predicts against the step each run measured.

    python3 docs/data/h200-any/replan.py docs/data/h200-any/run > docs/data/h200-any/replan.txt
"""

import json
import statistics
import sys
from pathlib import Path

from chunkflow_planner.catalog import load_profile
from chunkflow_planner.plan import load_plan, model_of
from chunkflow_planner.planner import ResolvedHardware, make_plan

run = Path(sys.argv[1])
here = Path(__file__).parent
old = load_profile(here.parent / "h200-tiers" / "run" / "profile.yaml")
new = load_profile(here / "profile-hd64.yaml")
print("name     head dim  measured step  planned then       planned with head dim 64's table")
for name in ("ltx", "cog", "i2v5b"):
    plan = load_plan(run / f"{name}-plan.json")
    spec, w = model_of(plan), plan.workload.to_workload()
    report = json.loads((run / f"{name}-report.json").read_text())
    measured = statistics.median(report["measured"]["step_times_s"])
    steps = {}
    for label, hw in (("then", old), ("now", new)):
        again = make_plan(spec, w, ResolvedHardware(hw, label), budget=plan.memory_budget_bytes,
                          host_budget=plan.host_memory_budget_bytes)[0]
        steps[label] = again.prediction.step_time_s
    hd = spec.d // spec.heads
    print(f"{name:8s} {hd:8d}  {measured:11.3f} s  {steps['then']:.3f} s ({measured / steps['then'] - 1:+.1%})  "
          f"{steps['now']:.3f} s ({measured / steps['now'] - 1:+.1%})")
