"""CPU tests of the runtime: the same control flow as on CUDA, with synchronous copies."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

import chunkflow  # noqa: E402
from chunkflow import OffloadError  # noqa: E402
from chunkflow.probes import ChunkLog  # noqa: E402
from tiny import MODULES as MODELS  # noqa: E402
from tiny import flux as _flux  # noqa: E402
from tiny import wan as _wan  # noqa: E402


CASES = [("none", 1, 0.0), ("layerwise", 1, 0.0), ("chunkflow", 4096, 0.0), ("chunkflow", 3001, 0.0),
         ("chunkflow", 3001, 0.3), ("chunkflow", 50_000, 0.5), ("chunkflow", 1000, 1.0), ("chunkflow", "1MB", 0.0)]


def _run(m, kw):
    with torch.no_grad():
        return m(**kw)[0]


def _snapshot(m):
    return [(n, id(p), p.device, p.dtype, p.detach().clone()) for n, p in m.named_parameters()] + \
           [(n, id(b), b.device, b.dtype, b.clone()) for n, b in m.named_buffers()]


def _same(m, snap) -> bool:
    """The same tensors (objects, devices, dtypes, values) and classes as before offload."""
    now = _snapshot(m)
    plain = all(type(p) is torch.nn.Parameter for p in m.parameters()) and all(
        not type(x).__dict__.get("_chunkflow_base") for x in m.modules())
    return plain and len(now) == len(snap) and all(
        a[0] == b[0] and a[1] == b[1] and a[2] == b[2] and a[3] == b[3] and torch.equal(a[4], b[4])
        for a, b in zip(now, snap))


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("mode,chunk,r", CASES)
def test_bit_exact_and_remove_restores(model, mode, chunk, r):
    m, blocks, kw = MODELS[model]()
    ref = _run(m, kw)
    snap = _snapshot(m)
    h = chunkflow.offload(m, mode=mode, chunk_size=chunk, residency=r, device="cpu", blocks=blocks)
    for _ in range(3):
        assert torch.equal(_run(m, kw), ref)
    assert [id(p) for p in m.parameters()] == [s[1] for s in snap if s[0] in dict(m.named_parameters())]
    st = h.stats()
    if mode != "none" and r == 1.0:  # fully resident: nothing to stream, no forwards counted by the ring
        assert st.achieved_residency == 1.0 and st.n_streamed_blocks == 0 and st.h2d_bytes_issued == 0
    elif mode != "none":
        assert st.forwards == 3
        assert st.host_bytes == sum(b.nbytes for b in h.layouts) + sum(
            b.host_offset - (a.host_offset + a.nbytes) for a, b in zip(h.layouts, h.layouts[1:]))
    h.remove()
    assert _same(m, snap)
    assert torch.equal(_run(m, kw), ref)
    with pytest.raises(OffloadError):  # removed twice is harmless; offloading again works
        h2 = chunkflow.offload(m, mode=mode, chunk_size=chunk, residency=r, device="cpu", blocks=blocks)
        chunkflow.offload(m, mode=mode, chunk_size=chunk, residency=r, device="cpu", blocks=blocks)
    h2.remove()
    assert _same(m, snap)


@pytest.mark.parametrize("model", ["wan", "wan_mixed", "flux"])
@pytest.mark.parametrize("chunk,r", [(4096, 0.0), (3001, 0.3), (7000, 0.5), (3001, 0.77), (1000, 1.0), (None, 0.0)])
def test_every_streamed_byte_copied_once_per_step(model, chunk, r):
    m, blocks, kw = MODELS[model]()
    mode = "layerwise" if chunk is None else "chunkflow"
    h = chunkflow.offload(m, mode=mode, chunk_size=chunk or 1, residency=r, device="cpu", blocks=blocks)
    log = h.add_observer(ChunkLog())
    n_streamed = sum(b.is_streamed for b in h.layouts)
    for step in range(3):
        log.clear()
        _run(m, kw)
        per_block: dict[int, list] = {}
        for c in log:
            if c.kind == "h2d":
                per_block.setdefault(c.block, []).append((c.start, c.end))
        assert len(per_block) == n_streamed
        for b in h.layouts:
            ranges = sorted(per_block.get(b.index, []))
            if not b.is_streamed:
                assert not ranges
                continue
            # union covers exactly [R_l, V_l), no overlap, no gap
            assert ranges[0][0] == b.resident_bytes and ranges[-1][1] == b.nbytes
            assert all(x[1] == y[0] for x, y in zip(ranges, ranges[1:]))
            if chunk is not None:
                assert all(e - s == chunk for s, e in ranges[:-1]) and ranges[-1][1] - ranges[-1][0] <= chunk
            else:
                assert len(ranges) == 1
        assert sum(e - s for v in per_block.values() for s, e in v) == h.stats().streamed_bytes_per_step
    # chunk copies come in issue order, one block after the other, the next block's after the current's
    orders = [c.order for c in log]
    assert orders == sorted(orders)
    h.remove()


@pytest.mark.parametrize("r", [0.0, 0.1, 0.3, 0.5, 0.77, 1.0])
@pytest.mark.parametrize("chunk", [1000, 3001, 16384])
def test_residency_within_one_chunk(r, chunk):
    m, blocks, kw = _wan(mixed=True)
    h = chunkflow.offload(m, mode="chunkflow", chunk_size=chunk, residency=r, device="cpu", blocks=blocks)
    for b in h.layouts:
        assert abs(b.resident_bytes - r * b.nbytes) <= chunk
        assert b.resident_bytes % chunk == 0 or b.resident_bytes == b.nbytes
    st = h.stats()
    assert abs(st.achieved_residency - r) <= chunk / min(b.nbytes for b in h.layouts)
    assert st.resident_bytes + st.streamed_bytes_per_step == sum(b.nbytes for b in h.layouts)
    h.remove()


def test_host_bytes_at_most_105_percent_of_offloaded():
    m, blocks, _ = _wan()  # all dims multiples of 64 fp32 elements: no alignment padding to speak of
    h = chunkflow.offload(m, mode="chunkflow", chunk_size="4KB", device="cpu", blocks=blocks)
    st = h.stats()
    assert st.bytes_offloaded > 0
    assert st.host_bytes <= 1.05 * st.bytes_offloaded
    assert st.pinned_bytes == 0  # no CUDA: nothing pinned
    assert h.store.data.numel() == st.host_bytes
    h.remove()


def test_streaming_memory_is_two_slots_allocated_once():
    m, blocks, kw = _wan()
    h = chunkflow.offload(m, mode="chunkflow", chunk_size=3001, residency=0.3, device="cpu", blocks=blocks)
    slots = [s.data_ptr() for s in h.streamer.slots]
    _run(m, kw)
    _run(m, kw)
    assert [s.data_ptr() for s in h.streamer.slots] == slots
    assert h.stats().slot_bytes == max(b.slot_extent for b in h.layouts)
    # between forwards every block tensor is its view of the host store: true shape, host memory
    store = h.store.data
    lo, hi = store.data_ptr(), store.data_ptr() + store.numel()
    for b in h.layouts:
        for t in b.tensors:
            p = getattr(t.owners[0][0], t.owners[0][1])
            assert tuple(p.shape) == t.shape and p.device.type == "cpu" and lo <= p.data_ptr() < hi
    h.remove()


def test_odd_block_count_and_single_block():
    m, blocks, kw = _wan()
    ref = _run(m, kw)
    h = chunkflow.offload(m, mode="chunkflow", chunk_size=4000, device="cpu", blocks=[m.blocks[1]])
    for _ in range(3):
        assert torch.equal(_run(m, kw), ref)
    h.remove()
    assert torch.equal(_run(m, kw), ref)


# ------------------------------------------------------------------------------------------ bad input


def _bad(m, **kw):
    snap = _snapshot(m)
    with pytest.raises(OffloadError) as e:
        chunkflow.offload(m, **kw)
    assert _same(m, snap)
    assert not hasattr(m, "_chunkflow_handle")
    return str(e.value)


def test_bad_inputs_raise_and_leave_module_untouched(tmp_path):
    m, blocks, kw = _wan()
    assert "must be in [0, 1]" in _bad(m, residency=1.5, device="cpu", blocks=blocks)
    assert "must be in [0, 1]" in _bad(m, residency=-0.1, device="cpu", blocks=blocks)
    assert "positive" in _bad(m, chunk_size=0, device="cpu", blocks=blocks)
    assert "positive" in _bad(m, chunk_size=-5, device="cpu", blocks=blocks)
    assert "cannot be parsed" in _bad(m, chunk_size="sixteen", device="cpu", blocks=blocks)
    assert "mode" in _bad(m, mode="fast", device="cpu", blocks=blocks)
    other = torch.nn.Sequential(torch.nn.Linear(4, 4))
    msg = _bad(other, device="cpu")
    assert "blocks=" in msg
    assert "submodule" in _bad(m, device="cpu", blocks=[other[0]])
    if not torch.cuda.is_available():
        msg = _bad(m, device="cuda", blocks=blocks)
        assert "CUDA is not available" in msg and "device='cpu'" in msg
    assert "does not exist" in _bad(m, plan=tmp_path / "nope.json", device="cpu", blocks=blocks)


def _plan_for(name: str, chunk_bytes: int = 4096, **offload):
    """A plan for the catalog model `name` that describes it truly (load_plan compares the two)."""
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.plan import Plan

    spec = get_model(name)
    return Plan.model_validate({
        "model": {"name": name, "n_blocks": spec.n_blocks, "block_bytes_total": spec.block_bytes_total,
                  "non_block_bytes": spec.non_block_bytes},
        "workload": {"batch": 1, "frames": 1, "height": 1024, "width": 1024, "tokens": 4096, "steps": 28},
        "parallel": {}, "hardware": {"name": "h200", "peak_tflops": 1, "h2d_gbps": 1, "eta_comp": 1, "eta_pref": 1},
        "analysis": {"block_flops_per_gpu": 1, "prefetch_bytes_per_block": 1, "f_star": 1, "i_block": 1, "i_star": 1,
                     "t_comp_s": 1, "t_pref_s": 1, "regime": "hidden", "critical": {"axis": "batch", "value": None}},
        "offload": {"mode": "chunkflow", "chunk_bytes": chunk_bytes, "residency": 0.25, **offload},
        "prediction": {"step_time_s": 1, "peak_memory_bytes": 1,
                       "baselines": {"none": {"step_time_s": 1, "peak_memory_bytes": 1},
                                     "layerwise": {"step_time_s": 1, "peak_memory_bytes": 1}}},
    })


def test_plan_for_another_model_or_another_size_is_refused(tmp_path):
    plan = _plan_for("FLUX.1-dev", chunk_bytes=16 * 10**6)
    m, blocks, kw = _wan()
    msg = _bad(m, plan=plan, device="cpu", blocks=blocks)
    assert "FLUX.1-dev" in msg and "WanTransformer3DModel" in msg
    f, fblocks, fkw = _flux()  # the right class, but a tiny FLUX, not FLUX.1-dev: its architecture differs
    msg = _bad(f, plan=plan, device="cpu")
    assert "another size" in msg and "57 blocks" in msg and "5 blocks" in msg
    for bad in (123, [1], str(tmp_path)):
        assert "plan" in _bad(f, plan=bad, device="cpu")


def test_a_plan_drives_the_module_it_was_made_for(tmp_path):
    from diffusers import WanTransformer3DModel

    from chunkflow.models.inputs import make_inputs
    from chunkflow_planner.catalog import get_model

    spec = get_model("tiny-wan")
    torch.manual_seed(0)
    m = WanTransformer3DModel(**spec.diffusers.config).eval()
    kw = make_inputs(spec, None, torch.float32, "cpu", seed=1)
    ref = _run(m, kw)
    plan = _plan_for("tiny-wan").model_dump()
    from chunkflow_planner.workload import tokens

    plan["workload"] = dict(spec.default_workload.model_dump(), tokens=tokens(spec, spec.default_workload))
    path = tmp_path / "plan.json"
    path.write_text(__import__("json").dumps(plan))
    for source in (path, str(path), plan):  # a file path, or the plan as a dict
        h = chunkflow.offload(m, plan=source, device="cpu")  # blocks from the catalog adapter
        assert h.stats().chunk_bytes == 4096 and h.stats().target_residency == 0.25
        assert torch.equal(_run(m, kw), ref)
        h.remove()


class _Cudart:
    """Records cudaHostRegister / cudaHostUnregister (this machine has no CUDA); `fail_at`: the registration that
    returns an error (cudaErrorHostMemoryAlreadyRegistered's number, any non-zero does)."""

    def __init__(self, fail_at: int | None = None):
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.threads: set[str] = set()
        self.fail_at = fail_at

    def cudaHostRegister(self, ptr, nbytes, flags):
        import threading

        self.threads.add(threading.current_thread().name)
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            return 712
        self.registered.append((ptr, nbytes))
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


@pytest.mark.parametrize("fail_at", [None, 2])
def test_a_host_store_is_locked_block_by_block_beside_its_writes(monkeypatch, fail_at):
    """Given the blocks' spans, the store is page-locked span by span on a thread of its own (what a loader's reads
    overlap); the spans cover the store, every block's tensors lie inside its own span (no copy crosses a
    registration); wait() raises a failed registration; release() unregisters every span registered."""
    from chunkflow.runtime.layout import block_spans, store_bytes
    from chunkflow.runtime.store import HostStore, HostStoreError

    m, blocks, _ = _wan()
    h = chunkflow.offload(m, mode="chunkflow", chunk_size="4KB", residency=0.3, device="cpu", blocks=blocks)
    layouts = h.layouts
    spans = block_spans(layouts)
    total = store_bytes(layouts)
    assert spans[0][0] == 0 and sum(n for _, n in spans) == total
    assert all(o + n == spans[i + 1][0] for i, (o, n) in enumerate(spans[:-1]))
    for (o, n), b in zip(spans, layouts):
        assert o == b.host_offset and all(o <= o + e.offset and e.offset + e.nbytes <= n for e in b.tensors)
    rt = _Cudart(fail_at)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    store = HostStore(total, pin=True, ranges=spans)
    base = store.data.data_ptr()
    if fail_at is None:
        store.wait()
        assert rt.registered == [(base + o, n) for o, n in spans] and store.pinned_bytes == total
    else:
        with pytest.raises(HostStoreError, match="cudaHostRegister"):
            store.wait()
        assert len(rt.registered) == fail_at
    assert rt.threads == {"chunkflow-pin"}
    store.release()
    assert rt.unregistered == [p for p, _ in rt.registered] and store.pinned_bytes == 0
    single = _Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: single)
    one = HostStore(total, pin=True)  # no spans: locked at once, in the caller's thread
    assert single.registered == [(one.data.data_ptr(), total)] and single.threads != {"chunkflow-pin"}
    one.release()
    monkeypatch.undo()
    h.remove()


# ------------------------------------------------------------------------------------------ the parts' seams


def test_a_part_on_the_handle_is_attached_detached_and_closed_with_each_layout():
    """The handle's parts protocol (runtime/feature.py): a part registered on the handle sees each layout come and
    go (a dtype change lays the blocks out again) and the handle's end, remove() and discard() alike."""
    from chunkflow.runtime.feature import HandleFeature

    class Record(HandleFeature):
        def __init__(self):
            self.calls = []

        def attach(self, handle):
            self.calls.append(("attach", handle.streamer is not None and bool(handle.layouts)))

        def detach(self, handle):
            self.calls.append(("detach", bool(handle.layouts)))

        def close(self, handle, restore):
            self.calls.append(("close", restore))

    for end, restore in (("remove", True), ("discard", False)):
        m, blocks, kw = _wan()
        h = chunkflow.offload(m, mode="chunkflow", chunk_size=3001, device="cpu", blocks=blocks)
        part = Record()
        h.features.append(part)
        m.to(torch.float64)
        assert h.stats().relayouts == 1 and part.calls == [("detach", True), ("attach", True)]
        getattr(h, end)()
        assert part.calls[2:] == [("close", restore), ("detach", True)] and h.removed
        getattr(h, end)()  # ended once
        assert len(part.calls) == 4


def test_block_features_are_called_around_every_block_in_order():
    """The streamer's per-block seam: each block's copies done (the next block's, prefetched as a block starts),
    entered and exited, once per block per forward, with the outputs unchanged."""
    from chunkflow.runtime.feature import BlockFeature

    class Record(BlockFeature):
        def __init__(self):
            self.calls = []

        def copies_done(self, streamer, block, slot):
            self.calls.append(("copies", block))

        def entered(self, streamer, block):
            self.calls.append(("enter", block))

        def exited(self, streamer, block):
            self.calls.append(("exit", block))

    m, blocks, kw = _wan()
    ref = _run(m, kw)
    h = chunkflow.offload(m, mode="chunkflow", chunk_size=3001, device="cpu", blocks=blocks)
    rec = Record()
    h.streamer.features.append(rec)
    assert torch.equal(_run(m, kw), ref)
    n = len(h.layouts)
    assert rec.calls == [c for l in range(n) for c in (("copies", (l + 1) % n), ("enter", l), ("exit", l))]
    h.remove()
