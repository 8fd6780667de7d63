"""A GGUF module's quantized bytes in the shared tier (one host copy for the ranks of a torchrun job, gloo on the
CPU): each rank loads the module diffusers builds from the same .gguf file; both stream bit-identically to the module
without chunkflow from one segment (its bytes counted once), the digests agree (the quant types are in them), and
remove() gives back GGUFParameters; every supported type, the streamed blocks' weights decoded ahead (asked for,
runtime/codecs/ahead.py)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _one(folder: Path, qtype) -> dict:
    """One rank's run of the type's file: offloaded into the shared tier, against the module without chunkflow."""
    import torch
    from diffusers import WanTransformer3DModel
    from diffusers.quantizers.gguf.utils import GGUFParameter

    from chunkflow.runtime.handle import offload
    from chunkflow_planner.offload import OffloadConfig
    from gguf_files import load_gguf, wan_inputs

    m = load_gguf(WanTransformer3DModel, folder / f"wan-{qtype.name}.gguf", folder)
    kw = wan_inputs()
    with torch.no_grad():
        ref = m(**kw)[0]
    h = offload(m, OffloadConfig("chunkflow", "64KB", 0.3, decode="ahead"), device="cpu", blocks=[m.blocks])
    with torch.no_grad():
        out = m(**kw)[0]
    st = h.stats()
    res = dict(equal=torch.equal(out, ref), shared_blocks=st.shared_blocks, shared_bytes=st.shared_bytes,
               owner=st.shared_owner, host_bytes=st.host_bytes, decoded=st.decoded_tensors)
    import torch.distributed as dist

    dist.barrier()
    h.remove()
    with torch.no_grad():
        res["removed_equal"] = torch.equal(m(**kw)[0], ref)
    res["gguf_params"] = sum(type(p) is GGUFParameter for p in m.parameters())
    return res


def _worker(out_path: str) -> None:
    import torch.distributed as dist

    from gguf_files import Q, wan_gguf

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    folder = Path(out_path).parent / "file"
    types = [Q.Q8_0, Q.Q6_K, Q.Q5_K, Q.Q4_K, Q.Q4_0]
    if rank == 0:
        folder.mkdir(exist_ok=True)
        for q in types:
            wan_gguf(folder, q)
    dist.barrier()
    res = {q.name: _one(folder, q) for q in types}
    gathered = [None, None]
    dist.all_gather_object(gathered, res)
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_gguf_blocks_one_copy_per_host(tmp_path, workers):
    got = workers(__file__, 2, tmp_path / "result.json", timeout=400)
    assert sorted(got[0]) == sorted(got[1]) == sorted(["Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0"])
    for qtype in got[0]:
        r0, r1 = got[0][qtype], got[1][qtype]
        assert r0["equal"] and r1["equal"] and r0["removed_equal"] and r1["removed_equal"], qtype
        assert r0["shared_blocks"] == r1["shared_blocks"] == 2, qtype
        assert r0["shared_bytes"] == r1["shared_bytes"] > 0 and r0["owner"] != r1["owner"], qtype
        assert r0["gguf_params"] == r1["gguf_params"] > 0, qtype
        assert r0["decoded"] == r1["decoded"] > 0, qtype  # the streamed blocks' weights decoded ahead (asked for)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    _worker(sys.argv[1])
    # the ranks end here, their results written: without Python's finalization, where gloo's teardown has aborted
    # a rank after its work ("terminate called without an active exception", twice in CI on 2026-12-06)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)
