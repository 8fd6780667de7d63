"""Host memory per host under sequence parallelism (issue 40): what the ranks of one host share, what each holds.

Under Ulysses SP of degree n, all n ranks on one host (torchrun), every rank runs the whole pipeline. With
`OffloadConfig.share_host` (the default) the runtime keeps one copy per host of

- each streamed module's host-tier tails [R_l, V_l): the streamed bytes of the transformer's blocks not on the disk
  tier (with a codec, as encoded: local rank 0 encodes them once), and a streamed text encoder's layers (streamed
  whole: no resident head);
- each component placed `phase`, parked in pinned host memory outside its phase;

in one shared pinned segment, and every rank holds the rest on its own: the blocks' resident heads [0, R_l), the
non-block tensors, disk-tier rings and spill files, components on the CPU, its process (runtime, CUDA context), the
decoded output. Without sharing every byte is a rank's own. So

    M_host = M_shared + n M_rank                                                                (eq. H1)

with M_rank a process's bytes less M_shared (all of them without sharing). One rank (SP 1) holds M_host = M_rank +
M_shared, the process's bytes as before. The load follows the same split (`host_load`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from chunkflow_planner.memory import stored_volumes
from chunkflow_planner.offload import OffloadConfig, disk_block_indices, resident_list

if TYPE_CHECKING:
    from chunkflow_planner.catalog import ModelSpec
    from chunkflow_planner.pipeline.load import LoadEstimate
    from chunkflow_planner.pipeline.placement import ExpertRun, Placements

SHARED_PLACEMENTS = ("phase", "stream")  # the placements whose host copies (all, or the streamed tails) are shared


@dataclass(frozen=True)
class HostSplit:
    """Host bytes of one host (eq. H1): `shared` held once, `per_rank` by each of `ranks` ranks."""

    shared: int
    per_rank: int
    ranks: int

    @property
    def per_host(self) -> int:
        """M_host = M_shared + n M_rank (eq. H1)."""
        return self.shared + self.ranks * self.per_rank


def host_split(host_bytes: dict[str, float], shared_bytes: dict[str, float], ranks: int,
               share_host: bool) -> HostSplit:
    """The split of a process's host bytes by holder (`host_bytes`) into the part the ranks share (`shared_bytes`,
    where `share_host`) and each rank's own; one rank holds int(sum(host_bytes)) exactly, as before SP was planned."""
    total = int(sum(host_bytes.values()))
    shared = int(sum(shared_bytes.values())) if share_host and ranks > 1 else 0
    return HostSplit(shared, total - shared, ranks)


def streamed_tail_bytes(spec: ModelSpec, cfg: OffloadConfig, hw=None) -> float:
    """The host tier's streamed tails sum of V_l - R_l over the blocks not on the disk tier, in their stored dtype
    (with a codec, encoded: codec.encoded_bytes, as memory.py holds them); 0 where nothing streams."""
    if not cfg.streams:
        return 0.0
    from chunkflow_planner.codec import encoded_bytes

    V = stored_volumes(spec, cfg)
    disk = set(disk_block_indices(len(V), cfg.disk_blocks))
    tails = [v - r for v, r in zip(V, resident_list(cfg, V))]
    return encoded_bytes(float(sum(t for l, t in enumerate(tails) if l not in disk)), cfg.codec, hw)


def shared_host_bytes(spec: ModelSpec, pl: Placements, runs: tuple[ExpertRun, ...], hw=None) -> dict[str, float]:
    """The host bytes of each holder (as phases.estimate names them) the ranks of a host can share: a text encoder
    placed `phase` whole, `stream` its layers; each expert placed `phase` whole, streamed (or on disk) its host-tier
    tails (streamed_tail_bytes); the VAE placed `phase` whole."""
    out: dict[str, float] = {}
    for te, p in zip(spec.pipeline.text_encoders, pl.text_encoders):
        if p == "phase":
            out[te.component] = float(te.nbytes)
        elif p == "stream":
            out[te.component] = float(te.layer_params * te.dtype_bytes * te.shape()["layers"])
    out["transformer"] = sum(float(spec.nbytes) if r.placement == "phase"
                             else streamed_tail_bytes(spec, r.point.cfg, hw) if r.placement in ("stream", "disk")
                             else 0.0 for r in runs)
    if pl.vae == "phase":
        out["vae"] = float(spec.pipeline.vae.nbytes)
    return out


def streamed_shared(pl: Placements, shared_bytes: dict[str, float], spec: ModelSpec) -> float:
    """Of the shared bytes, the streamed modules' tails: page-locked while their blocks are read (load.py's
    B_pin,r); the rest (parked components) are locked when parked."""
    tes = {te.component: p for te, p in zip(spec.pipeline.text_encoders, pl.text_encoders)}
    total = sum(b for k, b in shared_bytes.items() if tes.get(k) == "stream")
    if pl.transformer in ("stream", "disk"):
        total += shared_bytes.get("transformer", 0.0)
    return float(total)


def host_load(est: LoadEstimate, shared: float, shared_streamed: float, ranks: int, share_host: bool,
              read_scale: float = 1.0) -> LoadEstimate:
    """The load of all `ranks` ranks of a host from one rank's (`est`), kept simple: the ranks load at once and
    share the host's disk, page-locking and memory, so the bytes read, page-locked and first touched are summed
    over the ranks, the shared ones (`shared`, of which `shared_streamed` are streamed tails) once, by local rank 0,
    which reads them and fills the segment (`read_scale`: bytes stored per parameter byte, as the load scales its
    reads); each rank copies to its own GPU over its own link at once,
    so the device copies and the codec's encode are one rank's. The other ranks' waiting for rank 0's segment is
    not modelled apart: its bytes are in the summed reads. One rank: `est` as is."""
    if ranks <= 1:
        return est
    s, s_str = (shared, shared_streamed) if share_host else (0.0, 0.0)
    s_read = min(est.read_bytes, s * read_scale)

    def summed(one: float, once: float) -> float:
        return once + ranks * max(0.0, one - once)

    return replace(est, read_bytes=summed(est.read_bytes, s_read), pinned_bytes=summed(est.pinned_bytes, s),
                   pinned_while_reading=summed(est.pinned_while_reading, s_str),
                   fresh_bytes=ranks * est.fresh_bytes, spill_bytes=ranks * est.spill_bytes,
                   host_peak_bytes=summed(est.host_peak_bytes, s))
