"""torch.compile (inductor, on the CPU) with an offloaded transformer, in either order.

Regional compilation (diffusers' `compile_repeated_blocks`, fullgraph True and False) compiles each block's own
call; chunkflow's hooks run outside it, so the compiled graph is the one without offload and the outputs are
bit-identical to the compiled model without offload, with one graph for all blocks of a kind (the hooked blocks'
class differs from the original's, so offloading adds at most one graph per block class, never one per block).
Compiling the
whole module (`torch.compile(module)`, `module.compile()`) puts graph breaks around each block's hooks: each
block's forward is still compiled (once, for every block), and the output matches the whole-compiled model
without offload within float rounding (the graph breaks change what inductor fuses).
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

pytest.importorskip("diffusers")
if shutil.which("g++") is None and shutil.which("c++") is None:  # inductor's CPU backend compiles C++
    pytest.skip("no C++ compiler for inductor on this machine", allow_module_level=True)

import chunkflow  # noqa: E402
from tiny import MODULES  # noqa: E402

pytestmark = pytest.mark.slow
CFG = dict(mode="chunkflow", chunk_size=3001, residency=0.3, device="cpu")


def _run(m, kw):
    with torch.no_grad():
        return m(**kw)[0]


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture
def fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("kind", ["wan", "flux"])
def test_regional_compile_in_either_order_is_bit_identical_to_compiled_without_offload(fresh, kind, fullgraph):
    ref, blocks, kw = MODULES[kind]()
    before, after = copy.deepcopy(ref), copy.deepcopy(ref)
    ref.compile_repeated_blocks(fullgraph=fullgraph)
    want = _run(ref, kw)
    graphs = _graphs()
    before.compile_repeated_blocks(fullgraph=fullgraph)  # compile, then offload
    h1 = chunkflow.offload(before, **CFG)
    h2 = chunkflow.offload(after, **CFG)  # offload, then compile
    after.compile_repeated_blocks(fullgraph=fullgraph)
    classes = len({type(b).__name__ for b in blocks for b in b})
    assert torch.equal(_run(before, kw), want) and torch.equal(_run(after, kw), want)
    settled = _graphs()
    assert settled - graphs <= classes  # at most one more graph per block class, not one per block
    for _ in range(3):
        assert torch.equal(_run(before, kw), want)
        assert torch.equal(_run(after, kw), want)
    assert _graphs() == settled  # and none after the first offloaded forward
    n = sum(len(b) for b in blocks)
    for h in (h1, h2):  # every call of a compiled block ran its forward, noted inside the compiled region
        st = h.stats()
        assert (st.blocks_computed, st.blocks_skipped) == (4 * n, 0) and st.forwards == 4
    h1.remove()
    h2.remove()
    assert torch.equal(_run(before, kw), want) and torch.equal(_run(after, kw), want)


def test_whole_module_compile_in_either_order(fresh):
    ref, blocks, kw = MODULES["wan"]()
    m1, m2, m3 = copy.deepcopy(ref), copy.deepcopy(ref), copy.deepcopy(ref)
    want = _run(torch.compile(ref), kw)
    h1 = chunkflow.offload(torch.compile(m1), **CFG)  # a compiled module: its _orig_mod is offloaded
    assert h1.module is m1
    compiled_after = torch.compile(m2)
    h2 = chunkflow.offload(m2, **CFG)
    h3 = chunkflow.offload(m3, **CFG)
    m3.compile()
    for m in (h1.module, compiled_after, m3):
        outs = [_run(m, kw) for _ in range(3)]
        assert all(torch.equal(o, outs[0]) for o in outs)  # stable forward to forward
        torch.testing.assert_close(outs[0], want, rtol=1e-5, atol=1e-5)
    graphs = _graphs()
    for m in (h1.module, compiled_after, m3):
        _run(m, kw)
    assert _graphs() == graphs  # no graph per block: every block of the class runs the same compiled forward
    for h in (h1, h2, h3):
        h.remove()


def test_a_module_compiled_while_offloaded_runs_as_the_plain_model_after_remove(fresh):
    """issue 51: `torch.compile(m)` of an offloaded module, two calls, `remove()`: the compiled code held the hooked
    class's `__call__` and the next call raised AttributeError. Now dynamo sees the hook gone, compiles the plain
    model, and the call gives what the same model compiled without chunkflow gives, bit for bit."""
    ref, blocks, kw = MODULES["wan"]()
    m = copy.deepcopy(ref)
    with torch.no_grad():
        eager = ref(**kw)[0]
    want = _run(torch.compile(ref), kw)
    h = chunkflow.offload(m, **CFG)
    compiled = torch.compile(m)
    for _ in range(2):
        torch.testing.assert_close(_run(compiled, kw), want, rtol=1e-5, atol=1e-5)  # graph breaks at the hooks
    h.remove()
    assert all(type(b) is type(blocks[0][0]) and "_chunkflow_base" not in type(b).__dict__ for b in blocks[0])
    for _ in range(2):
        assert torch.equal(_run(compiled, kw), want)
    torch.testing.assert_close(_run(compiled, kw), eager, rtol=1e-5, atol=1e-5)


def test_bench_compiles_the_repeated_blocks_before_offloading(cli, workdir, fresh):
    import pandas as pd

    result = cli("bench", "--model", "tiny", "--frames", "5", "--modes", "none,chunkflow", "--chunk-sizes", "4KB",
                 "--compile", "regional-fullgraph", "--steps", "1", "--no-plots", "--out", "b")
    assert result.exit_code == 0, result.output
    df = pd.read_csv(workdir / "b" / "bench.csv")
    assert df["bit_identical"].all() and len(df) == 2  # compiled chunkflow against compiled none
    assert "torch.compile: regional-fullgraph" in (workdir / "b" / "summary.md").read_text()
    assert cli("bench", "--model", "tiny", "--frames", "5", "--compile", "max").exit_code == 2


@pytest.mark.parametrize("order", ["compile-then-offload", "offload-then-compile"])
def test_a_whole_pipeline_with_a_compiled_offloaded_transformer(fresh, order):
    pytest.importorskip("transformers")
    from pipelines import call_kwargs, one_thread, tiny_pipeline

    with one_thread():
        ref = tiny_pipeline("wan")
        ref.transformer.compile_repeated_blocks(fullgraph=True)
        want = ref(**call_kwargs("wan"))[0]
        pipe = tiny_pipeline("wan")
        if order == "compile-then-offload":
            pipe.transformer.compile_repeated_blocks(fullgraph=True)
        h = chunkflow.offload(pipe.transformer, **CFG)
        if order == "offload-then-compile":
            pipe.transformer.compile_repeated_blocks(fullgraph=True)
        assert torch.equal(pipe(**call_kwargs("wan"))[0], want)
        assert torch.equal(pipe(**call_kwargs("wan"))[0], want)
        h.remove()
