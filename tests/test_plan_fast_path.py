"""The planner's fast path (issue 53: a plan in under half a second of CPU) decides exactly what pricing every point
in full decides: blocks alike priced once (offload.per_volume) and step times computed only for the points that are
asked for (policy.Point.time), and the transformer's candidates shared by the plan at a supposed disk rate
(pipeline/decide._disk_facts), give the same plan file, tables and messages, bit for bit, as every block of every
candidate priced and timed at once."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from chunkflow.commands.cli import app
from chunkflow_planner import memory, offload, policy, steptime
from chunkflow_planner.pipeline import decide

runner = CliRunner()

CASES = [  # varied: pipeline and transformer alone, budgets that bind, formats, levers, SP, disk tier, codec
    ["--model", "wan2.1-14b", "--frames", "81", "--height", "480", "--width", "832", "--mem-budget", "16GB",
     "--host-mem-budget", "64GB"],
    ["--model", "flux", "--mem-budget", "12GB", "--hardware", "rtx-4090", "--host-mem-budget", "48GB"],
    ["--model", "qwen", "--mem-budget", "16GB", "--hardware", "rtx-5090", "--host-mem-budget", "64GB", "--allow-fp8"],
    ["--model", "wan2.2", "--transformer-only", "--mem-budget", "10GB", "--hardware", "rtx-4090"],
    ["--model", "flux", "--format", "q4_k", "--mem-budget", "8GB", "--hardware", "rtx-4090", "--host-mem-budget",
     "32GB"],
    ["--model", "wan2.1-14b", "--sp", "2", "--hardware", "h200-x2", "--mem-budget", "30GB", "--host-mem-budget",
     "200GB"],
    ["--model", "wan2.1-14b", "--mem-budget", "24GB", "--hardware", "h200", "--host-mem-budget", "24GB",
     "--disk-gbps", "2"],
    ["--model", "wan2.1-14b", "--mem-budget", "24GB", "--hardware", "h200", "--host-mem-budget", "24GB"],  # host
    # memory binds, no disk rate: the plan at a supposed one is decided too, from the same candidates
    ["--model", "hunyuan", "--transformer-only", "--mem-budget", "12GB", "--max-slowdown", "1.01", "--hardware",
     "h200"],  # infeasible: the message is compared too
]


def _plan(args: list[str]) -> tuple[int, str]:
    result = runner.invoke(app, ["plan", *args, "--json"])
    return result.exit_code, result.output


def _exhaustive(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block priced on its own and every point timed when it is evaluated: the plain way."""
    def every_block(fn, V):  # noqa: ANN001, ANN202
        return [fn(v) for v in V]

    for module in (offload, steptime):
        monkeypatch.setattr(module, "per_volume", every_block)
    evaluate = policy.Problem.evaluate

    def timed_at_once(self, cfg):  # noqa: ANN001, ANN202
        point = evaluate(self, cfg)
        point.time  # noqa: B018
        return point

    monkeypatch.setattr(policy.Problem, "evaluate", timed_at_once)
    decide_again = decide.decide_pipeline

    def candidates_anew(*args, cands=None, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        return decide_again(*args, **kwargs)

    monkeypatch.setattr(decide, "decide_pipeline", candidates_anew)


@pytest.mark.parametrize("args", CASES, ids=[" ".join(a[:2] + a[-2:]) for a in CASES])
def test_the_fast_path_plans_what_pricing_every_point_plans(args, monkeypatch):
    fast = _plan(args)
    with monkeypatch.context() as m:
        _exhaustive(m)
        plain = _plan(args)
    assert fast == plain
    assert fast[0] in (0, 2) and fast[1]


def test_a_point_is_timed_on_first_use_and_equal_to_one_timed_at_once():
    from chunkflow_planner.catalog import get_hardware, get_model
    from chunkflow_planner.offload import OffloadConfig
    from chunkflow_planner.workload import make_workload

    spec = get_model("wan2.1-14b")
    problem = policy.Problem(spec, make_workload(spec), get_hardware("h200"))
    cfg = OffloadConfig("chunkflow", "16MB", 0.25, codec="exponent-pack")
    lazy = problem.evaluate(cfg)
    assert "time" not in vars(lazy)  # not timed yet
    direct = steptime.step_time(spec, problem.workload, problem.hw, cfg)
    assert lazy.time == direct and lazy.step_time == direct.total
    assert lazy == problem.evaluate(cfg)
