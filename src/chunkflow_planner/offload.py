"""The offload setting, in one place: `OffloadConfig`, and how it splits each block into resident and streamed bytes.

`OffloadConfig` is the only representation of an offload setting. CLI flags, the Python API's keywords, plan files
and bench sweeps all construct it, and its one constructor parses user input (sizes such as "16MB"), validates it
and normalises it: mode `none` keeps everything resident (residency 1, no chunks), `layerwise` copies whole blocks
(residency 0, no chunk size), `chunkflow` streams chunks of `chunk_bytes` (default 16 MB) and keeps the first
`residency` of every block resident.

Two levers cut the bytes streamed per unit of compute below the critical point (issue 15): `cfg_batched` runs the
guidance passes of a step as one forward of the doubled batch, so each block is streamed once a step, not once a
pass; `weight_dtype` "fp8_e4m3" keeps the streamed blocks' linear weights in float8 (diffusers' layerwise casting
arithmetic: a plain cast, no scale), halving their host, H2D and slot bytes, cast back on the GPU before use.

A third lever cuts the bytes without changing them (issue 39): `codec` "exponent-pack" stores a host-tier block's
streamed chunks losslessly encoded (a bf16 word's exponent as a K-bit index into the chunk's table), copies them
encoded into a device staging ring of CODEC_STAGING_CHUNKS buffers, each one decode group (`codec_group_chunks`
chunks, about CODEC_DECODE_BYTES of them), and decodes each group with one launch on the GPU into the block's slot.
The disk tier's blocks stream encoded too: their tails are encoded once at the load into a spill file chunkflow owns
and read from it each forward, encoded, into the disk ring. Its price (tiers.py) is the ratio on the link and in host memory, and the
decode on the GPU.

Block l keeps R_l = min(round(r n_l) C, V_l) bytes resident, whole chunks of its n_l = ceil(V_l / C), and streams
the rest in ceil((V_l - R_l) / C) copies; the blocks of `whole_blocks` keep all of theirs (R_l = V_l): a step cache
that runs only the first block on a step it skips (first-block caching, issue 54) then copies nothing that step. The memory and step-time models and the runtime's layout all use
`resident_bytes`, so planner and runtime see the same chunks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from chunkflow_planner.errors import ChunkflowError

from chunkflow_planner.units import DEFAULT_CHUNK_BYTES, UnitError, parse_size, short_bytes  # noqa: F401 (re-exported)

Mode = Literal["none", "layerwise", "chunkflow"]
MODES: tuple[str, ...] = ("none", "layerwise", "chunkflow")
WeightDtype = Literal["bf16", "fp8_e4m3"]
WEIGHT_DTYPES: tuple[str, ...] = ("bf16", "fp8_e4m3")  # bf16: the weights as the model holds them
Fp8Cast = Literal["compute", "copy"]
FP8_CASTS: tuple[str, ...] = ("compute", "copy")  # where a streamed block's fp8 weights become its compute dtype
FP8_BYTES_PER_PARAM = 1
DISK_RING_BLOCKS = 2  # disk tier: page-locked ring buffers, one disk block's streamed bytes each; reads run this far ahead
Codec = Literal["none", "exponent-pack"]
CODECS: tuple[str, ...] = ("none", "exponent-pack")  # none: streamed bytes travel as they are stored
Decode = Literal["ahead", "forward"]
# a stored format's quantized weights (GGUF, fp8-scaled): a streamed block's decoded on the copy stream right after its
# copies, into a decode buffer per slot ("ahead"), or by each layer in its own forward ("forward", diffusers' way)
DECODES: tuple[str, ...] = ("ahead", "forward")
CODEC_STAGING_CHUNKS = 3  # device buffers, each one decode group, the encoded copies land in (the runtime's)
CODEC_DECODE_BYTES = 64 << 20  # raw bytes one decode launch takes at most (whole chunks, at least one): fewer
# launches and events on the thread that also launches the forward (per-chunk decodes cost about 50 us each on one
# H200 with 4 MB chunks, docs/codec-h200.md)
PACING_MARGIN = 0.9  # share of a compute window chunk copies may fill when paced around collectives (both halves)


class OffloadConfigError(ChunkflowError):
    """An offload setting that cannot be used; the message says what was wrong and what to give instead."""


def resident_bytes(V: int | float, C: int | float, r: float) -> int | float:
    """R_l: the whole-chunk prefix of a V-byte block (chunks of C bytes, the last one shorter) nearest to r V."""
    if r <= 0 or V <= 0:
        return 0
    k = math.floor(r * V / C)
    below, above = min(k * C, V), min((k + 1) * C, V)
    return above if (above - r * V) <= (r * V - below) else below


def disk_block_indices(n_blocks: int, disk_blocks: int) -> list[int]:
    """The blocks whose streamed bytes the disk tier keeps in the checkpoint's files: `disk_blocks` of the
    `n_blocks`, spread evenly over the forward, so that each read overlaps the blocks between two disk blocks (the
    planner and the runtime use this one rule)."""
    k = max(0, min(int(disk_blocks), n_blocks))
    return [math.floor((i + 0.5) * n_blocks / k) for i in range(k)] if k else []


def _chunk(value: Any) -> int:
    """Bytes of a chunk size given as bytes or a size string; positive and finite."""
    if isinstance(value, bool):
        raise OffloadConfigError(f"chunk size {value!r} is not a size; give bytes or a string like '16MB'")
    if isinstance(value, (int, float)) and (not math.isfinite(value) or value <= 0):
        raise OffloadConfigError(f"chunk size {value!r} must be positive and finite; 4MB-64MB is a good range")
    try:
        return parse_size(value)
    except (UnitError, TypeError) as exc:
        raise OffloadConfigError(f"chunk size {value!r} cannot be parsed ({exc}); give bytes or e.g. '16MB'") from None


def _residency(value: Any) -> float:
    """A residency fraction: a real number in [0, 1] (not a bool, not a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OffloadConfigError(f"residency {value!r} is not a number; give a fraction in [0, 1]")
    r = float(value)
    if not 0.0 <= r <= 1.0:  # NaN fails too
        raise OffloadConfigError(f"residency {value!r} must be in [0, 1] (0 streams every byte, 1 keeps all on the device)")
    return r


def _whole_blocks(value: Any, mode: str) -> tuple[int, ...]:
    """Block indices kept wholly resident: distinct counts (0 or more), sorted; only mode chunkflow keeps a residency."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise OffloadConfigError(f"whole_blocks is a list of block indices (e.g. [0]), got {value!r}")
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in value):
        raise OffloadConfigError(f"whole_blocks holds block indices (0 or more), got {list(value)!r}")
    if value and mode != "chunkflow":
        raise OffloadConfigError(f"whole_blocks keeps some blocks wholly on the device and streams the others in "
                                 f"chunks; that is mode chunkflow, not {mode}. Use --mode chunkflow, or leave it out")
    return tuple(sorted(set(value)))


def _flag(data: dict, key: str, default: bool) -> bool:
    """The true-or-false field `key` of a setting's `data` (`default` where absent); anything else is refused."""
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise OffloadConfigError(f"{key} must be true or false, got {value!r}")
    return value


def _one_of(data: dict, key: str, default: str, allowed: tuple[str, ...]) -> str:
    """The field `key` of a setting's `data` (`default` where absent), one of `allowed`; anything else is refused."""
    value = data.get(key, default)
    if value not in allowed:
        raise OffloadConfigError(f"unknown {key} {value!r}; use one of {', '.join(allowed)}")
    return value


def _weight_storage(data: dict, mode: str) -> tuple[str, str]:
    """(weight_dtype, fp8_cast) of a setting's `data`: fp8 only where blocks stream, a cast place only for fp8."""
    weight_dtype = _one_of(data, "weight_dtype", "bf16", WEIGHT_DTYPES)
    if weight_dtype != "bf16" and mode == "none":
        raise OffloadConfigError(f"weight_dtype {weight_dtype} stores streamed weights; mode none streams nothing. "
                                 "Use mode chunkflow (residency 1 keeps every block on the device, in fp8)")
    fp8_cast = _one_of(data, "fp8_cast", "compute", FP8_CASTS)
    if weight_dtype == "bf16" and fp8_cast != "compute":
        raise OffloadConfigError(f"fp8_cast {fp8_cast!r} says where fp8-stored weights are cast; with weight_dtype "
                                 "bf16 nothing is cast. Store the weights in fp8 too (weight_dtype fp8_e4m3, "
                                 "--weight-dtype fp8_e4m3), or leave fp8_cast out")
    return weight_dtype, fp8_cast


def _disk_blocks(data: dict, mode: str, weight_dtype: str) -> int:
    """The disk tier's block count of a setting's `data`: 0 or more, only where blocks stream as stored (bf16)."""
    disk = data.get("disk_blocks", 0)
    if isinstance(disk, bool) or not isinstance(disk, int) or disk < 0:
        raise OffloadConfigError(f"disk_blocks is a count of blocks (0 or more), got {disk!r}")
    if disk and mode == "none":
        raise OffloadConfigError("disk_blocks keeps streamed bytes on disk; mode none streams nothing. Use mode "
                                 "layerwise or chunkflow")
    if disk and weight_dtype != "bf16":
        raise OffloadConfigError("the disk tier reads the checkpoint's bytes as they are; fp8 storage casts them. "
                                 "Use weight_dtype bf16 with disk_blocks")
    return disk


def _codec(data: dict, mode: str, weight_dtype: str) -> str:
    """The codec of a setting's `data`: a known one, and one other than none only where bf16 blocks stream."""
    codec = _one_of(data, "codec", "none", CODECS)
    if codec != "none" and mode == "none":
        raise OffloadConfigError(f"codec {codec} encodes streamed bytes; mode none streams nothing. Use mode "
                                 "layerwise or chunkflow, or leave the codec out")
    if codec != "none" and weight_dtype != "bf16":
        raise OffloadConfigError(f"codec {codec} encodes bf16 weights losslessly; weight_dtype {weight_dtype} "
                                 "stores them cast. Use one or the other (weight_dtype bf16 with the codec)")
    return codec


def _chunk_and_residency(data: dict, mode: str) -> tuple[int | None, float]:
    """(chunk bytes, residency) of a setting's `data`, as its mode has them: none keeps all (no chunks, 1), layerwise
    streams whole blocks (no chunks, 0), chunkflow chunks of `chunk_bytes` (default 16 MB) at its residency (0)."""
    residency = data.get("residency")
    if mode == "none":
        return None, 1.0
    if mode == "layerwise":
        if residency is not None and _residency(residency) != 0.0:
            raise OffloadConfigError("a residency is for mode chunkflow; mode layerwise streams whole blocks with no "
                                     "residency. Use mode chunkflow (--mode chunkflow), or leave it out")
        return None, 0.0
    given = data.get("chunk_bytes")
    chunk = DEFAULT_CHUNK_BYTES if given is None else _chunk(given)
    return chunk, 0.0 if residency is None else _residency(residency)


def _errors(exc: ValidationError) -> str:
    return "; ".join(str(e.get("ctx", {}).get("error", e["msg"])) for e in exc.errors())


class OffloadConfig(BaseModel):
    """One point of the design space: mode, chunk size C (bytes), residency r, communication awareness.

    `OffloadConfig("chunkflow", "16MB", 0.3)`; `chunk_bytes` takes bytes or a size string; residency None means the
    mode's default. Invalid input raises OffloadConfigError (from the constructor) or a pydantic ValidationError
    (from `model_validate`, e.g. a plan file), both ValueErrors.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Mode = "chunkflow"
    chunk_bytes: int | None = None
    residency: float = 0.0
    comm_aware: bool = True
    cfg_batched: bool = False
    weight_dtype: WeightDtype = "bf16"
    fp8_cast: Fp8Cast = "compute"  # fp8 storage: cast on the compute stream before the block runs, or on the copy
    # stream right after the block's copies (off the compute path, at the cost of a second cast buffer)
    disk_blocks: int = 0  # blocks whose streamed bytes stay in the checkpoint's files (the disk tier), read each forward
    codec: Codec = "none"  # how streamed bytes are stored and copied (host and disk tier): raw, or losslessly encoded
    share_host: bool = True  # under torchrun, the ranks of one host stream host-tier tails from one shared pinned copy
    # (runtime/tiers/shared.py) and park phase-placed components in one; False: each rank pins its own
    decode: Decode = "forward"  # a stored format's streamed blocks: decoded in their forward (diffusers' way), or ahead
    # of it on the copy stream (DECODES); forward by default: the step-time model prices ahead no faster (its kernels
    # share the SMs, steptime.py) and its two decode buffers take GPU memory (memory.py)
    whole_blocks: tuple[int, ...] = ()  # chunkflow: blocks (by index) kept wholly on the device, the others at residency

    def __init__(self, mode: str = "chunkflow", chunk_bytes: int | float | str | None = None,
                 residency: float | None = None, comm_aware: bool = True, *, cfg_batched: bool = False,
                 weight_dtype: str = "bf16", fp8_cast: str = "compute", disk_blocks: int = 0,
                 codec: str = "none", share_host: bool = True, decode: str = "forward",
                 whole_blocks: tuple[int, ...] | list[int] = ()) -> None:
        try:
            super().__init__(mode=mode, chunk_bytes=chunk_bytes, residency=residency, comm_aware=comm_aware,
                             cfg_batched=cfg_batched, weight_dtype=weight_dtype, fp8_cast=fp8_cast,
                             disk_blocks=disk_blocks, codec=codec, share_host=share_host, decode=decode,
                             whole_blocks=whole_blocks)
        except ValidationError as exc:
            raise OffloadConfigError(_errors(exc)) from None

    @model_validator(mode="before")
    @classmethod
    def _parse_and_normalise(cls, data: Any) -> Any:
        """`data`'s fields parsed, checked and normalised for its mode (the module docstring says how)."""
        if not isinstance(data, dict):
            return data
        mode = data.get("mode", "chunkflow")
        if mode not in MODES:
            raise OffloadConfigError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
        comm_aware = _flag(data, "comm_aware", True)
        cfg_batched = _flag(data, "cfg_batched", False)
        weight_dtype, fp8_cast = _weight_storage(data, mode)
        disk = _disk_blocks(data, mode, weight_dtype)
        codec = _codec(data, mode, weight_dtype)
        share_host = _flag(data, "share_host", True)
        decode = data.get("decode", "forward")
        if decode not in DECODES:
            raise OffloadConfigError(f"unknown decode {decode!r}; use ahead (a streamed block's quantized weights "
                                     "decoded on the copy stream before its forward) or forward (in each layer's)")
        whole = _whole_blocks(data.get("whole_blocks", ()), mode)
        chunk, r = _chunk_and_residency(data, mode)
        return {**data, "mode": mode, "chunk_bytes": chunk, "residency": r, "comm_aware": comm_aware,
                "cfg_batched": cfg_batched, "weight_dtype": weight_dtype, "fp8_cast": fp8_cast,
                "disk_blocks": disk, "codec": codec, "share_host": share_host, "decode": decode, "whole_blocks": whole}

    def with_overrides(self, mode: str | None = None, chunk_size: int | float | str | None = None,
                       residency: float | None = None, comm_aware: bool | None = None, *,
                       cfg_batched: bool | None = None, weight_dtype: str | None = None,
                       fp8_cast: str | None = None, disk_blocks: int | None = None,
                       codec: str | None = None, share_host: bool | None = None,
                       decode: str | None = None, whole_blocks: tuple[int, ...] | None = None) -> "OffloadConfig":
        """This setting with the given fields replaced (e.g. `chunkflow run --mode/--chunk-size/--residency` over a
        plan). A chunk size and residency carry over only from a chunkflow setting to a chunkflow setting; fp8
        storage only to a mode that streams. A chunk size or residency given for a mode without them is refused
        (it would be dropped without a word). The codec carries over to a mode that streams bf16 weights."""
        new_mode = mode or self.mode
        if new_mode in MODES and new_mode != "chunkflow" and (chunk_size is not None or (
                residency is not None and not (new_mode == "none" and _residency(residency) == 1.0)
                and not (new_mode == "layerwise" and _residency(residency) == 0.0))):
            given = "a chunk size" if chunk_size is not None else "a residency"
            does = "streams nothing" if new_mode == "none" else "copies whole blocks"
            raise OffloadConfigError(f"{given} ({chunk_size if chunk_size is not None else residency!r}) is for mode "
                                     f"chunkflow; the mode here is {new_mode}, which {does}. Add --mode chunkflow "
                                     "(mode='chunkflow'), or leave it out")
        keep = self.mode == "chunkflow" and new_mode == "chunkflow"
        dtype = weight_dtype or (self.weight_dtype if new_mode != "none" else "bf16")
        return OffloadConfig(
            new_mode,
            chunk_size if chunk_size is not None else (self.chunk_bytes if keep else None),
            residency if residency is not None else (self.residency if keep else None),
            self.comm_aware if comm_aware is None else comm_aware,
            cfg_batched=self.cfg_batched if cfg_batched is None else cfg_batched,
            weight_dtype=dtype,
            fp8_cast=fp8_cast if fp8_cast is not None else (self.fp8_cast if dtype != "bf16" else "compute"),
            disk_blocks=(disk_blocks if disk_blocks is not None
                         else self.disk_blocks if new_mode != "none" and dtype == "bf16" else 0),
            codec=codec if codec is not None else (self.codec if new_mode != "none" and dtype == "bf16" else "none"),
            share_host=self.share_host if share_host is None else share_host,
            decode=self.decode if decode is None else decode,
            whole_blocks=whole_blocks if whole_blocks is not None else (self.whole_blocks if keep else ()),
        )

    @classmethod
    def of_row(cls, mode: str, chunk_bytes: float | None, residency: float) -> "OffloadConfig":
        """The setting a table row (bench.csv: NaN for no chunk size) records, whatever its mode."""
        if mode != "chunkflow":
            return cls(mode)
        return cls(mode, int(chunk_bytes), float(residency))  # type: ignore[arg-type]

    @property
    def streams(self) -> bool:
        """Whether any block bytes live in host memory (every mode but `none`)."""
        return self.mode != "none"

    @property
    def label(self) -> str:
        """`none`, `layerwise` or `chunkflow C=16MB r=0.3` (r to 3 digits), with ` cfg-batched` and ` fp8` where set: for tables."""
        base = self.mode if self.mode != "chunkflow" else \
            f"chunkflow C={short_bytes(self.chunk_bytes or 0)} r={self.residency:.3g}"  # r=0.333, not 0.333333
        return base + self.levers_label

    @property
    def levers_label(self) -> str:
        """` cfg-batched`, ` fp8`, ` cast-on-copy`, ` disk=N`, ` codec=NAME`, ` unshared`, ` decode-ahead` and ` whole=0`
        where set (empty without
        levers): the tail of `label`."""
        fp8 = "" if self.weight_dtype == "bf16" else " fp8" + (" cast-on-copy" if self.fp8_cast == "copy" else "")
        disk = f" disk={self.disk_blocks}" if self.disk_blocks else ""
        codec = f" codec={self.codec}" if self.codec != "none" else ""
        unshared = "" if self.share_host else " unshared"
        decode = " decode-ahead" if self.decode == "ahead" else ""
        whole = f" whole={','.join(map(str, self.whole_blocks))}" if self.whole_blocks else ""
        return (" cfg-batched" if self.cfg_batched else "") + fp8 + disk + codec + unshared + decode + whole

    def stored_bytes(self, V: float, dtype_bytes: int = 2) -> float:
        """Bytes a V-byte block (weights of `dtype_bytes` each) occupies in storage: halved by fp8 for bf16 weights.
        The blocks' norm weights stay in their dtype; they are a fraction of a percent of a DiT block."""
        if self.weight_dtype == "bf16":
            return V
        return V * FP8_BYTES_PER_PARAM / dtype_bytes

    # ---- the split of one block, for the memory and step-time models

    def resident_bytes(self, V: float) -> float:
        """R_l: bytes of a V-byte block kept on the GPU, in whole chunks."""
        if self.chunk_bytes is None:  # none keeps the whole block, layerwise nothing
            return V if self.mode == "none" else 0.0
        return float(resident_bytes(V, float(self.chunk_bytes), self.residency))

    def streamed_bytes(self, V: float) -> float:
        """Bytes of a V-byte block copied host-to-device once per forward."""
        return V - self.resident_bytes(V)

    def copies(self, V: float) -> int:
        """H2D copies per forward for a V-byte block (each pays the DMA start-up cost)."""
        streamed = self.streamed_bytes(V)
        if streamed <= 0:
            return 0
        if self.chunk_bytes is None:
            return 1
        return math.ceil(streamed / float(self.chunk_bytes))

    def chunk_service_bytes(self, V: float) -> float:
        """Bytes of one copy: a chunk, or the whole streamed block for layerwise."""
        if self.chunk_bytes is None:
            return self.streamed_bytes(V)
        return min(float(self.chunk_bytes), self.streamed_bytes(V))


def streaming_volumes(cfg: OffloadConfig, V: list[float]) -> list[float]:
    """The blocks' volumes as the streaming sees them: a block of `cfg.whole_blocks` as 0 bytes (nothing streams,
    nothing decodes on the copy path), the others as they are; indices past the blocks are no block's."""
    whole = set(cfg.whole_blocks)
    return [0.0 if l in whole else float(v) for l, v in enumerate(V)]


def resident_list(cfg: OffloadConfig, V: list[float]) -> list[float]:
    """R_l of each block: all of a whole block's bytes, the others' `cfg.resident_bytes` (computed once per volume)."""
    R = per_volume(cfg.resident_bytes, V)
    whole = set(cfg.whole_blocks)
    return [float(V[l]) if l in whole else r for l, r in enumerate(R)]


def per_volume(fn: Callable[[float], Any], V: list[float]) -> list[Any]:
    """[fn(v) for v in V], with `fn` (a pure function of a block's volume) called once per distinct volume: most of
    a model's blocks are alike, and the policy prices hundreds of points (the same values, in the same order)."""
    once = {v: fn(v) for v in dict.fromkeys(V)}
    return [once[v] for v in V]


def codec_group_chunks(chunk_bytes: float) -> int:
    """Chunks of `chunk_bytes` one decode launch takes: as many as fit CODEC_DECODE_BYTES, at least one."""
    return max(1, int(CODEC_DECODE_BYTES // max(1.0, float(chunk_bytes))))


def codec_group_bytes(cfg: OffloadConfig, V: float) -> float:
    """Raw bytes of the largest decode group of a V-byte block: its chunks, `codec_group_chunks` at a time, within
    its streamed tail."""
    chunk = cfg.chunk_service_bytes(V)
    return min(cfg.streamed_bytes(V), codec_group_chunks(chunk) * chunk) if chunk > 0 else 0.0


def codec_groups(cfg: OffloadConfig, V: float) -> int:
    """Decode launches a V-byte block's streamed tail takes (its chunks, `codec_group_chunks` at a time)."""
    chunk = cfg.chunk_service_bytes(V)
    if chunk <= 0:
        return 0
    return math.ceil(math.ceil(cfg.streamed_bytes(V) / chunk) / codec_group_chunks(chunk))


def codec_staging_bytes(cfg: OffloadConfig, V: list[float]) -> float:
    """Device bytes of the codec's staging rings for blocks of stored volumes `V`: CODEC_STAGING_CHUNKS buffers of the
    largest decode group (an upper bound: the group's bytes encoded are fewer), one ring for the host tier's encoded
    blocks and one for the disk tier's where both have some (each tier owns its codec stream,
    chunkflow/runtime/codecs/stream.py); 0 without a codec or where nothing streams."""
    if cfg.codec == "none":
        return 0.0
    disk = set(disk_block_indices(len(V), cfg.disk_blocks))
    rings = 0.0
    group = per_volume(lambda v: codec_group_bytes(cfg, v), streaming_volumes(cfg, V))
    host_tier = [g for l, g in enumerate(group) if l not in disk] if disk else group
    for mine in (host_tier, [group[l] for l in sorted(disk)]):
        largest = max(mine, default=0.0)
        rings += CODEC_STAGING_CHUNKS * max(0.0, largest)
    return float(rings)
