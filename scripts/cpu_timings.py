#!/usr/bin/env python3
"""The CPU timings the README quotes, measured on this machine from the README's own commands (issue 53):

- its fresh-machine line (a venv, torch, the package with its extras, the demo's plan and run), each `&&` step
  timed, in a fresh copy of this commit (`git archive HEAD`) with pip's cache empty; pip's install reports
  (PIP_REPORT) say where each package came from;
- the demo's plan and run again, RUNS times, bytecode cached;
- every `chunkflow plan` line of the README that needs no weights, and `--help`: whole processes, one warm-up, then
  RUNS times each.

Wall seconds and CPU seconds (user + sys of the command and every process it waited for, from wait4) are both
kept: where another job shares the machine the wall times are upper bounds, the CPU times hold. Writes
OUT/cpu-timings.txt (what the README quotes) and OUT/cpu-timings.json (every sample); the commands' output goes
to OUT/cpu-timings.log (not committed).

    python3 scripts/cpu_timings.py docs/data/cpu-timings [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]


def timed(command: str, cwd: Path, env: dict[str, str], log: Path) -> dict:
    """`command` run by bash in `cwd`: {"wall_s", "cpu_s", "rc"}; its output appended to `log`."""
    with log.open("a") as out:
        out.write(f"\n$ {command}\n")
        out.flush()
        t0 = time.perf_counter()
        p = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    return {"wall_s": round(wall, 3), "cpu_s": round(usage.ru_utime + usage.ru_stime, 3), "rc": p.returncode}


def readme_commands(readme: str) -> tuple[list[str], list[str]]:
    """(the fresh-machine line's `&&` steps, every standalone `chunkflow plan` line that needs no weights)."""
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", readme, re.S)
    lines = [x.split("  #")[0].strip() for b in blocks for x in b.replace("\\\n", " ").splitlines()]
    (fresh,) = [x for x in lines if "chunkflow plan --model demo" in x and "&&" in x]
    plans = [x for x in lines if x.startswith("chunkflow plan ") and "--weights" not in x]
    return [s.strip() for s in fresh.split(" && ")], plans


def clean_env(home: Path) -> dict[str, str]:
    """This environment without any Python or venv setting of its own, pip's cache an empty folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_CACHE"))}
    env.update(PIP_CACHE_DIR=str(home / "pip-cache"), CHUNKFLOW_CONFIG_DIR=str(home / "config"), COLUMNS="100")
    return env


def sources(report: Path, tree: Path) -> dict[str, int]:
    """Where a pip install report's packages came from (downloaded from a host, a folder on this machine, the
    repository itself) -> how many."""
    out: dict[str, int] = {}
    for item in json.loads(report.read_text()).get("install", []):
        url = urlparse(item["download_info"]["url"])
        if url.scheme.startswith("http"):
            where = f"downloaded from {url.netloc}"
        elif Path(url.path) == tree:
            where = "the repository's folder"
        else:
            where = f"this machine's {Path(url.path).parent}"
        out[where] = out.get(where, 0) + 1
    return out


def fresh_machine(steps: list[str], tree: Path, env: dict[str, str], log: Path) -> list[dict]:
    """Each step of the fresh-machine line in order, in `tree`: its timing, and for a pip step its sources."""
    rows = []
    for i, step in enumerate(steps):
        report = tree.parent / f"pip-report-{i}.json"
        row = {"command": step, **timed(step, tree, dict(env, PIP_REPORT=str(report)), log)}
        if report.exists():
            row["sources"] = sources(report, tree)
        rows.append(row)
        if row["rc"] != 0:
            raise SystemExit(f"{step!r} exited {row['rc']}: see {log}")
    return rows


def repeated(command: str, runs: int, tree: Path, env: dict[str, str], log: Path, warm_up: bool = True) -> dict:
    """`command` `runs` times (after one run not counted, if `warm_up`): every sample, the medians."""
    if warm_up:
        timed(command, tree, env, log)
    samples = [timed(command, tree, env, log) for _ in range(runs)]
    return {"command": command, "samples": samples,
            "wall_s": statistics.median(s["wall_s"] for s in samples),
            "cpu_s": statistics.median(s["cpu_s"] for s in samples),
            "cpu_range": [min(s["cpu_s"] for s in samples), max(s["cpu_s"] for s in samples)]}


def machine(venv_python: Path) -> dict:
    """The machine, the fresh venv's Python and torch, the commit, the load average now."""
    mem = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) * 1024
    cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
    probe = "import platform, torch; print(platform.python_version(), torch.__version__)"
    python, torch = subprocess.run([str(venv_python), "-c", probe], capture_output=True, text=True,
                                   check=True).stdout.split()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {"date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "cpus": os.cpu_count(),
            "cpu": cpu.group(1).strip() if cpu else platform.machine(), "memory_gib": round(mem / 2**30, 1),
            "python": python, "torch": torch, "commit": commit.stdout.strip(), "load": load()}


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _row(r: dict) -> str:
    spread = f" ({r['cpu_range'][0]:.2f}-{r['cpu_range'][1]:.2f})" if "cpu_range" in r else ""
    where = "; packages " + ", ".join(f"{k}: {v}" for k, v in r["sources"].items()) if r.get("sources") else ""
    return f"{r['wall_s']:8.2f} {r['cpu_s']:8.2f}{spread:13} {r['command']}{where}"


def summary(m: dict, fresh: list[dict], demo: dict, plans: list[dict], runs: int) -> str:
    """The text the README quotes: the machine, then each measurement a line (wall s, CPU s, command)."""
    installs = [r for r in fresh if "chunkflow" not in r["command"]]
    first = [r for r in fresh if "chunkflow" in r["command"]]
    lines = [f"# CPU timings the README quotes, measured by scripts/cpu_timings.py at commit {m['commit']}, "
             f"{m['date']}",
             f"# this machine: {m['cpus']} CPUs ({m['cpu']}), {m['memory_gib']} GiB, no GPU; the fresh venv's "
             f"Python {m['python']}, torch {m['torch']}",
             f"# load average before {m['load']}, after {m['load_after']} (these commands count one): over about "
             "1, another job shared the machine and the wall times are upper bounds; CPU = user + sys of the "
             "command and every process it waited for",
             "", "The README's fresh-machine line, step by step, in a fresh copy of the commit, pip's cache empty:",
             "  wall s    CPU s              command", *map(_row, fresh),
             f"  installs together: {sum(r['wall_s'] for r in installs):.1f} s wall, "
             f"{sum(r['cpu_s'] for r in installs):.1f} s CPU; plan and run together (their first run, chunkflow's "
             f"bytecode compiled then): {sum(r['wall_s'] for r in first):.1f} s wall, "
             f"{sum(r['cpu_s'] for r in first):.1f} s CPU",
             "", f"The demo's plan and run again, median of {runs} (CPU min-max), bytecode cached:", _row(demo),
             "", f"The README's plan lines and --help: whole processes, median of {runs} after one warm-up "
             "(CPU min-max), bytecode cached:", *map(_row, plans)]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder for cpu-timings.txt, .json and .log")
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    load_before = load()
    steps, plan_lines = readme_commands((ROOT / "README.md").read_text())
    log = a.out / "cpu-timings.log"
    log.write_text("")
    with tempfile.TemporaryDirectory(prefix="cpu-timings-") as tmp:
        home = Path(tmp)
        tree = home / "chunkflow"
        tree.mkdir()
        subprocess.run(f"git archive HEAD | tar -x -C {tree}", shell=True, cwd=ROOT, check=True)
        env = clean_env(home)
        fresh = fresh_machine(steps, tree, env, log)
        m = dict(machine(tree / ".venv" / "bin" / "python"), load=load_before)
        demo = repeated(" && ".join(s for s in steps if "chunkflow" in s), a.runs, tree, env, log, warm_up=False)
        commands = [".venv/bin/" + x for x in plan_lines] + [".venv/bin/chunkflow --help"]
        plans = [repeated(c, a.runs, tree, env, log) for c in commands]
    m["load_after"] = load()
    (a.out / "cpu-timings.json").write_text(json.dumps(
        {"machine": m, "fresh_machine": fresh, "demo": demo, "plans": plans}, indent=1) + "\n")
    (a.out / "cpu-timings.txt").write_text(summary(m, fresh, demo, plans, a.runs))
    print((a.out / "cpu-timings.txt").read_text(), end="")


if __name__ == "__main__":
    main()
