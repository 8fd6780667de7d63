"""`chunkflow bench`: sweep workload, mode, chunk size and residency; write CSV, plots and a summary.

sweep.py defines what is measured, measure.py measures it (single GPU or Ulysses SP under torchrun),
choices.py asks the planner what it would pick, plots.py and summary.py draw and tabulate from bench.csv and
bench.json alone, so `chunkflow bench --from-dir DIR` redraws a GPU run on any machine.
"""

from __future__ import annotations

import importlib
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

__all__ = ["COLUMNS", "BenchError", "BenchMeta", "BenchSpec", "PlannerChoice", "planner_choice",
           "run_bench", "write_outputs", "load"]

# the package's names, each imported from its module on first use: the command line imports bench.command to
# register `chunkflow bench`, and `chunkflow --help` or `plan` should not pay for the planner and pandas here
_LAZY = {"PlannerChoice": "choices", "planner_choice": "choices", "COLUMNS": "measure",
         "OPTIONAL_COLUMNS": "measure", "run_bench": "measure", "BenchError": "sweep", "BenchMeta": "sweep",
         "BenchSpec": "sweep"}

if TYPE_CHECKING:  # pragma: no cover
    from chunkflow.commands.bench.choices import PlannerChoice, planner_choice
    from chunkflow.commands.bench.measure import COLUMNS, OPTIONAL_COLUMNS, run_bench
    from chunkflow.commands.bench.sweep import BenchError, BenchMeta, BenchSpec


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"chunkflow.commands.bench.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def write_outputs(df, meta: BenchMeta, out: Path, plots: bool = True) -> list[Path]:
    """bench.csv, bench.json, summary.md and (plots=True) the PNGs in `out`; returns the paths written."""
    from chunkflow.commands.bench.choices import planner_choice
    from chunkflow.commands.bench.summary import summary_markdown
    from chunkflow_planner.catalog import HardwareSpec, get_model
    from chunkflow_planner.files import write_atomic

    out.mkdir(parents=True, exist_ok=True)
    spec = get_model(meta.spec.model)
    hw = HardwareSpec.model_validate(meta.hardware)
    choice = planner_choice(spec, meta.spec, hw, meta.sp)
    paths = [out / "bench.csv", out / "bench.json", out / "summary.md"]
    write_atomic(paths[0], df.to_csv(index=False))
    meta.write(paths[1])
    write_atomic(paths[2], summary_markdown(df, meta, choice))
    if plots:
        from chunkflow.commands.bench.plots import plot_all

        paths += plot_all(df, meta, spec, hw, choice, out)
    return paths


def load(out: Path):
    """(DataFrame, BenchMeta) of a directory written by `chunkflow bench`."""
    import pandas as pd

    from chunkflow.commands.bench.measure import COLUMNS, OPTIONAL_COLUMNS
    from chunkflow.commands.bench.sweep import BenchError, BenchMeta
    from chunkflow_planner.files import FileError, read_text

    if not out.is_dir():
        raise BenchError(f"{out} not found: --from-dir needs a directory written by chunkflow bench")
    meta = BenchMeta.read(out / "bench.json")
    csv = out / "bench.csv"
    if not csv.is_file():
        raise BenchError(f"{csv} not found next to {out / 'bench.json'}")
    try:
        df = pd.read_csv(io.StringIO(read_text(csv, "bench CSV")))  # a regular file of bounded size
    except FileError as exc:
        raise BenchError(str(exc)) from None
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise BenchError(f"{csv} cannot be read as the bench's CSV ({exc}); run chunkflow bench again") from None
    if df.empty:
        raise BenchError(f"{csv} holds no measured point; run chunkflow bench again")
    missing = [c for c in COLUMNS if c not in df.columns and c not in OPTIONAL_COLUMNS]
    if missing:
        raise BenchError(f"{csv} lacks columns {', '.join(missing)}; it was not written by this chunkflow bench")
    return df.reindex(columns=COLUMNS), meta
