"""docs/data/gpu-cache/probe.py's `record` mode: one generation with every forward computed, the first-block cache's
own measure recorded, and a threshold chosen on skips simulated from it (issue 54's evidence: two thresholds cost two
Wan generations on an H100 and neither fired). Up to the first skip the run and the recording see the same forwards,
so the simulation's first skip is the run's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pipelines import call_kwargs, one_thread, tiny_pipeline

pytest.importorskip("diffusers")

PROBE = Path(__file__).resolve().parents[1] / "docs" / "data" / "gpu-cache" / "probe.py"


def _probe():
    spec = importlib.util.spec_from_file_location("cache_probe", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_simulated_share_falls_with_the_threshold_from_all_forwards_to_the_first_alone():
    probe = _probe()
    contexts = [[0.3, 0.1, 0.5, 0.2, 0.2, 0.05, 0.4], [0.6, 0.15, 0.35]]  # two cache contexts (guidance passes)
    every = [m for c in contexts for m in c]
    thresholds = [0.0, 0.04, 0.1, 0.25, 0.45, 0.8, sum(every)]
    shares = [probe.simulated_share(contexts, t) for t in thresholds]
    assert shares[0] == shares[1] == 1.0 and shares[-1] == 2 / (len(every) + 2)  # each context's first forward
    assert all(a >= b for a, b in zip(shares, shares[1:])) and len(set(shares)) > 3
    t, share = probe.chosen_from_record(contexts, 0.5)
    assert share == probe.simulated_share(contexts, t) < 1
    others = {probe.simulated_share(contexts, u) for u in every}
    assert all(abs(share - 0.5) <= abs(v - 0.5) for v in others if v < 1)


@pytest.mark.parametrize("kind", ["flux", "wan"])
def test_the_recorded_measures_give_the_runs_first_skip(kind):
    """A threshold under every recorded measure computes every forward in the run too; the chosen one skips in the
    run where the simulation says it skips (Wan: two guidance passes a step, each its own cache context)."""
    probe = _probe()
    pipe = tiny_pipeline(kind)
    kw = call_kwargs(kind, num_inference_steps=8)
    kw.pop("generator")
    with one_thread():
        contexts = probe.recorded_measures(pipe, kw, 0, "cpu")
        assert len(contexts) == (2 if kind == "wan" else 1) and all(len(c) == 7 for c in contexts)
        lowest = min(m for c in contexts for m in c)
        assert lowest > 0 and probe.computed_share(pipe, lowest * 0.99, kw, 0, "cpu") == 1.0
        t, simulated = probe.chosen_from_record(contexts, 0.65)
        assert simulated < 1 and probe.computed_share(pipe, t, kw, 0, "cpu") < 1
