"""Loading a pipeline from its checkpoint folder, predicted before anything is read: how long it takes, from cold
files and from the page cache, and the host memory it holds while it runs.

The loader (chunkflow/loading) reads every tensor once, straight into its final place (a pinned store, the device
through a small staging buffer per reader thread, or the CPU), and drops the page-cache pages its reads bring in.
So the load is the start-up (imports, the modules built on the meta device, tokenizers), the reads, the copies to
the device and the page-locking of the host stores. A streamed module's host store is page-locked on a thread of
its own while its blocks are read into it (B_pin,r: the locking overlaps the reads); the parked tensors' homes are
locked when a component is parked, after its reads (B_pin,p):

    T_load = t_start + max(B_read / BW_read(c), B_pin,r / BW_pin) + B_h2d / BW_h2d
             + B_pin,p / BW_pin + B_fresh / BW_fault + B_enc / BW_enc + B_spill / BW_disk         (eq. L1)
    1 / BW_read(c) = c / BW_cache + (1 - c) / BW_disk                                             (eq. L2)
    M_load = M_start + host copies + M_staging (+ the device's part where the device is the host)   (eq. L3)

with c the share of the files the page cache held before the load (0: cold, 1: warm), and M_start the process
before any kernel ran (`process_start_host_bytes`, else `process_host_bytes`): the load comes before the first
generation, whose kernels load libraries of their own (about 1 GB more on an H100). A component placed `phase`
is read onto the device and then parked: its bytes cross the host link twice. Every host byte is new memory the
kernel maps at its first touch: page-locking does that for the pinned stores (BW_pin includes it), the first
write for the rest (B_fresh: components on the CPU, and everything where the device is the host). The rates are measured by
`chunkflow calibrate` (the disk the weights are on, cold and warm; page-locking), t_start by `calibrate
--from-report` from generation reports. B_enc: the streamed tails a codec encodes at the load (issue 39), at the
profile's end-to-end BW_enc (HardwareSpec.codec_encode_gbps). With a codec the disk tier's tails are among them: the
load reads them raw from the checkpoint's files (in B_read, which without a codec leaves them for the forwards),
encodes them and writes the encoded bytes, B_spill, to the codec's spill file, at the disk's read rate (supposed:
writes are not measured).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chunkflow_planner.catalog import HardwareSpec, ModelSpec
from chunkflow_planner.overlap import GB

READ_THREADS = 8  # the loader's reader threads (chunkflow.loading.reader.READ_THREADS)
PIECE_BYTES = 16 * 2**20  # one read request and one staging buffer per thread (chunkflow.loading.reader.PIECE_BYTES)
STAGING_BYTES = (READ_THREADS + 1) * PIECE_BYTES  # a buffer per reader thread and one for the calling thread


@dataclass(frozen=True)
class LoadEstimate:
    """What a load moves: bytes read from the files, copied to the device (both ways for parked components), and
    page-locked in host memory; the host bytes it holds at its end."""

    read_bytes: float
    h2d_bytes: float
    pinned_bytes: float
    host_peak_bytes: float
    fresh_bytes: float = 0.0  # host bytes first touched by their write (not page-locked before)
    pinned_while_reading: float = 0.0  # the part of pinned_bytes locked while the reads run (host stores)
    encoded_bytes: float = 0.0  # streamed tails the codec encodes at the load (raw bytes)
    spill_bytes: float = 0.0  # the disk tier's tails encoded, written once to the codec's spill file


def BW_read(cached: float, hw: HardwareSpec) -> float | None:
    """Bytes per second reading checkpoint files of which a share `cached` is in the page cache (eq. L2); None where
    the profile has no measured disk rate."""
    if hw.disk_read_gbps is None:
        return None
    cache = hw.pipeline.page_cache_gbps if hw.pipeline.page_cache_gbps is not None else hw.disk_read_gbps
    c = min(1.0, max(0.0, cached))
    return 1.0 / (c / (cache * GB) + (1.0 - c) / (hw.disk_read_gbps * GB))


def T_load(est: LoadEstimate, cached: float, hw: HardwareSpec) -> float | None:
    """Seconds of a load (eq. L1) with a share `cached` of its files in the page cache; None without a disk rate."""
    bw = BW_read(cached, hw)
    if bw is None:
        return None
    return sum(load_parts(est, cached, hw).values())


def load_parts(est: LoadEstimate, cached: float, hw: HardwareSpec) -> dict[str, float]:
    """Where T_load goes (eq. L1): start-up, reads, copies to the device, the page-locking the reads do not hide,
    new memory (empty without a disk rate). The stores' locking overlaps the reads of all components together (each
    component's reads and store are in about the same proportion)."""
    bw = BW_read(cached, hw)
    if bw is None:
        return {}
    read = est.read_bytes / bw
    parts = {"startup": hw.pipeline.load_startup_s, "read": read}
    if not hw.pipeline.device_is_host:
        parts["to device"] = est.h2d_bytes / (hw.h2d_gbps * GB)
        if hw.pipeline.pin_gbps is not None:  # what the reads do not hide: the locking they outlast, then the parked homes'
            during = min(est.pinned_while_reading, est.pinned_bytes)
            parts["pin"] = (max(0.0, during / (hw.pipeline.pin_gbps * GB) - read)
                            + (est.pinned_bytes - during) / (hw.pipeline.pin_gbps * GB))
    if hw.pipeline.host_fault_gbps is not None and est.fresh_bytes:
        parts["new memory"] = est.fresh_bytes / (hw.pipeline.host_fault_gbps * GB)
    if est.encoded_bytes and hw.codec_encode_gbps is not None:  # the codec's tails: to the GPU, encoded, back
        parts["encode"] = est.encoded_bytes / (hw.codec_encode_gbps * GB)
    if est.spill_bytes:
        parts["spill"] = spill_s(est.spill_bytes, hw)
    return parts


def spill_s(nbytes: float, hw: HardwareSpec) -> float:
    """B_spill / BW_disk (eq. L1): seconds writing the codec's spill file, at the disk's read rate (supposed: chunkflow
    measures reads, not writes)."""
    return float(nbytes) / (hw.disk_read_gbps * GB)


def _text_encoder_split(te) -> tuple[float, float]:
    """(bytes of its streamed layers, bytes outside them) of a text encoder."""
    layers = te.layer_params * te.dtype_bytes * te.shape()["layers"]
    return float(layers), float(te.nbytes - layers)


def _experts(placements, memory, n: int, expert_memory) -> list[tuple[str, Any]]:
    """(placement, memory.MemoryEstimate) of each of `n` experts: `expert_memory` where given, else `memory` at
    each expert's placement."""
    if expert_memory is not None:
        return list(expert_memory)
    return [(p, memory) for p in placements.of_experts(n)]


@dataclass
class _LoadTally:
    """The bytes a load moves, added up component by component (load_estimate's running sums)."""

    h2d: float = 0.0
    pinned: float = 0.0
    during: float = 0.0  # bytes of host stores, locked while their blocks are read
    device_now: float = 0.0  # device bytes that stay (gpu)
    parked: float = 0.0  # the largest component parked after its load (phase)
    fresh: float = 0.0
    unread: float = 0.0  # bytes on the disk tier: read at their phase, not at the load
    encoded: float = 0.0  # streamed tails the codec encodes at the load
    spill: float = 0.0  # the disk tier's tails encoded, written to the codec's spill file

    def stays_on_device(self, nbytes: float) -> None:
        """A component placed `gpu`: copied to the device once, where it stays."""
        self.h2d += nbytes
        self.device_now += nbytes

    def parks_after_load(self, nbytes: float) -> None:
        """A component placed `phase`: read onto the device, then parked in page-locked host memory (it crosses the
        host link twice)."""
        self.h2d += 2 * nbytes
        self.pinned += nbytes
        self.parked = max(self.parked, nbytes)


def _tally_text_encoders(tally: _LoadTally, pipe, placements, host_bytes: dict[str, float]) -> None:
    """Adds each text encoder's bytes at its placement to `tally`."""
    for te, p in zip(pipe.text_encoders, placements.text_encoders):
        layers, rest = _text_encoder_split(te)
        if p == "cpu":
            tally.fresh += te.nbytes
        elif p == "gpu":
            tally.stays_on_device(te.nbytes)
        elif p == "phase":
            tally.parks_after_load(te.nbytes)
        elif p == "stream":
            tally.h2d += 2 * rest
            tally.pinned += layers + rest
            tally.during += layers
        elif p == "disk":  # read at its phase, not at the load: only its ring is page-locked
            tally.unread += te.nbytes
            tally.pinned += host_bytes.get(te.component, 0.0)


def _tally_experts(tally: _LoadTally, spec: ModelSpec, experts: list[tuple[str, Any]], t_bytes: float) -> None:
    """Adds each transformer expert's bytes, (placement, memory.MemoryEstimate) in `experts`, to `tally`."""
    for where, m in experts:
        if where == "disk":  # its resident heads read into the pinned store; the rest at its turns (with a codec, its
            # tails read now, encoded into the spill file)
            tally.h2d += m.resident_block_weights
            tally.pinned += m.pinned_host
            tally.during += m.pinned_host
            tally.unread += t_bytes - m.resident_block_weights - m.codec_spill_raw
            tally.encoded += m.codec_spill_raw
            tally.spill += m.codec_spill
        elif where == "gpu":
            tally.stays_on_device(t_bytes)
        elif where == "phase":
            tally.parks_after_load(t_bytes)
        else:
            # to the device: non-block tensors and resident chunks; parked: the non-block tensors back to host
            # memory; disk blocks' tails stay in the files, or with a codec are read now, encoded into the spill file
            tally.h2d += 2 * m.non_block_weights + m.resident_block_weights
            tally.pinned += m.pinned_host + spec.non_block_bytes
            tally.during += m.pinned_host
            tally.unread += m.disk_read if m.codec_spill_raw == 0 else 0.0
            tally.encoded += m.codec_raw + m.codec_spill_raw
            tally.spill += m.codec_spill


def _tally_vae(tally: _LoadTally, vae: float, placement: str) -> None:
    """Adds the VAE's `vae` bytes at its placement to `tally` (any placement but disk and gpu parks it)."""
    if placement == "disk":
        tally.unread += vae
    elif placement == "gpu":
        tally.stays_on_device(vae)
    else:
        tally.parks_after_load(vae)


def load_process_bytes(hw: HardwareSpec) -> float:
    """M_start: a started process's host memory before its first kernels (process_start_host_bytes, else
    process_host_bytes)."""
    start = hw.pipeline.process_start_host_bytes
    return float(hw.pipeline.process_host_bytes if start is None else start)


def _host_peak(host_bytes: dict[str, float], hw: HardwareSpec, staging: bool | None, tally: _LoadTally) -> float:
    """M_load (eq. L3): the plan's host memory with the process before its first kernels (load_process_bytes), the
    staging buffers where used (`staging` None: on a GPU) and, where the device is the host, the device's part."""
    staging = (not hw.pipeline.device_is_host) if staging is None else staging
    host = sum(v for k, v in host_bytes.items() if k not in ("output", "device", "process"))
    host += load_process_bytes(hw) if "process" in host_bytes else 0.0
    host += STAGING_BYTES if staging else 0.0
    if hw.pipeline.device_is_host:  # the device's part is host memory too: what stays, and the largest parked one in passing
        host += tally.device_now + tally.parked
    return host


def load_estimate(spec: ModelSpec, placements, transformer_memory, host_bytes: dict[str, float], hw: HardwareSpec,
                  read_bytes: float | None = None, staging: bool | None = None,
                  expert_memory: Sequence[tuple[str, Any]] | None = None) -> LoadEstimate:
    """What loading `spec`'s pipeline placed as `placements` (pipeline.Placements) moves: `transformer_memory` is
    the streamed transformer's memory.MemoryEstimate, `host_bytes` the plan's host memory by holder. `read_bytes`:
    the checkpoint's bytes as stored (default: every component's parameters in its own dtype). `staging`: whether
    the reader's staging buffers are used (default: on a GPU, where every device tensor passes through them).
    `expert_memory`: each expert's (placement, MemoryEstimate) where they differ (PipelineEstimate.experts)."""
    pipe = spec.pipeline
    t_bytes = float(spec.nbytes)
    tally = _LoadTally()
    _tally_text_encoders(tally, pipe, placements, host_bytes)
    _tally_experts(tally, spec, _experts(placements, transformer_memory, pipe.experts, expert_memory), t_bytes)
    vae = float(pipe.vae.nbytes)
    _tally_vae(tally, vae, placements.vae)
    total = sum(spec.component_bytes().values())
    # what stays on disk is not read at the load (read_bytes, from the headers, is scaled by the same share)
    read = float(total if read_bytes is None else read_bytes) * max(0.0, 1.0 - tally.unread / total)
    if hw.pipeline.device_is_host:  # no host link to cross, nothing page-locked; every byte is new host memory, a parked
        # component's twice (the device's copy, then its parking)
        tally.fresh = float(total) + sum(b for b, p in _placed_bytes(spec, placements, t_bytes, vae) if p == "phase")
        tally.h2d = tally.pinned = tally.during = 0.0
    host = _host_peak(host_bytes, hw, staging, tally)
    return LoadEstimate(read, tally.h2d, tally.pinned, host, tally.fresh, tally.during, tally.encoded, tally.spill)


def _placed_bytes(spec: ModelSpec, placements, t_bytes: float, vae: float) -> list[tuple[float, str]]:
    pipe = spec.pipeline
    out = [(float(te.nbytes), p) for te, p in zip(pipe.text_encoders, placements.text_encoders)]
    out += [(t_bytes, p) for p in placements.of_experts(pipe.experts)]
    return out + [(vae, placements.vae)]
