"""A step cache, as `--cache KIND[:PARAMS]` gives it: which of diffusers' caches and its parameters, validated once.

    first-block:0.1                       diffusers' FirstBlockCacheConfig(threshold=0.1)
    mag:ratios=flux                       MagCacheConfig with diffusers' FLUX ratios (its threshold 0.06 ...)
    mag:0.1,max_skip_steps=2,ratios=r.json   ratios from a JSON list of numbers (e.g. what `mag:calibrate` printed)
    mag:calibrate                         MagCache's calibration: nothing skipped, the ratios printed at the end
    taylorseer:2,lite                     TaylorSeerCacheConfig(cache_interval=2, use_lite_mode=True)
    sea:0.3                               SeaCacheConfig(threshold=0.3)

PARAMS is a comma-separated list of `key=value`, a bare number for the kind's main parameter (a threshold; for
taylorseer the interval) and bare names for flags (`lite`, `calibrate`). The defaults are diffusers'. MagCache's step
count is the run's (the runtime sets it). Pure Python: the planner can price a cache from this model without torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.files import read_bounded

MAX_RATIOS_BYTES = 2**20  # a list of a few thousand ratios, one a step


class CacheSpecError(ChunkflowError):
    """A `--cache` that cannot be used: the message names what was wrong and what is accepted."""


Threshold = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class _Cache(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FirstBlockCache(_Cache):
    """First-block caching: the remaining blocks are skipped while the first block's residual changes by less than
    `threshold` (relative mean absolute difference) from the last computed step's."""

    kind: Literal["first-block"] = "first-block"
    threshold: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        0.05, description="relative change of the first block's residual under which the other blocks are skipped")


class MagCache(_Cache):
    """MagCache: steps skipped while the accumulated error of the calibrated magnitude ratios stays under
    `threshold`; the ratios are the model's (`flux`: diffusers' FLUX.1 ratios)."""

    kind: Literal["mag"] = "mag"
    threshold: Threshold = Field(0.06, description="accumulated error under which a step's blocks are skipped")
    max_skip_steps: int = Field(3, ge=1, description="most steps skipped in a row")
    retention_ratio: float = Field(0.2, ge=0, le=1, description="share of the first steps never skipped")
    ratios: Literal["flux"] | list[Annotated[float, Field(gt=0, allow_inf_nan=False)]] | None = Field(
        None, description="magnitude ratios per step: 'flux' (diffusers' FLUX ratios) or a list")
    calibrate: bool = Field(False, description="measure the ratios instead (nothing skipped, printed at the end)")

    @model_validator(mode="after")
    def _ratios_or_calibrate(self) -> "MagCache":
        if (self.ratios is None) == (not self.calibrate):
            raise ValueError("mag needs the model's magnitude ratios: ratios=flux (diffusers' FLUX ratios), "
                             "ratios=FILE.json (a list of numbers), or calibrate (a run that measures them), one of "
                             "them")
        return self


class TaylorSeerCache(_Cache):
    """TaylorSeer: outputs computed every `cache_interval` steps and predicted by a Taylor expansion in between;
    `lite` predicts only the output projection and skips the blocks whole (diffusers' lite mode)."""

    kind: Literal["taylorseer"] = "taylorseer"
    cache_interval: int = Field(5, ge=1, description="steps between two computed ones")
    disable_cache_before_step: int = Field(3, ge=0, description="first steps always computed")
    disable_cache_after_step: int | None = Field(None, ge=0, description="steps from which all are computed")
    max_order: int = Field(1, ge=0, le=4, description="order of the Taylor expansion")
    lite: bool = Field(False, description="skip whole blocks, predict the output projection only")


class SeaCache(_Cache):
    """SeaCache: the repeated blocks replaced by a cached residual while the spectral indicator's accumulated change
    stays under `threshold` (diffusers' adapters: Wan text-to-video, Cosmos 3)."""

    kind: Literal["sea"] = "sea"
    threshold: Threshold = Field(0.25, description="accumulated relative-L1 budget")
    residual_order: int = Field(1, ge=0, le=1, description="0 reuses the last residual, 1 extrapolates from two")
    retention_steps: int = Field(1, ge=0, description="first steps always computed")
    cache_end_steps: int = Field(1, ge=0, description="last steps always computed")
    max_consecutive_cached: int = Field(2, ge=0, description="most reuses in a row (0: no limit)")


CacheSetting = Annotated[Union[FirstBlockCache, MagCache, TaylorSeerCache, SeaCache], Field(discriminator="kind")]
KINDS = {"first-block": FirstBlockCache, "mag": MagCache, "taylorseer": TaylorSeerCache, "sea": SeaCache}
MAIN = {"first-block": "threshold", "mag": "threshold", "taylorseer": "cache_interval", "sea": "threshold"}
FLAGS = {"mag": ("calibrate",), "taylorseer": ("lite",)}
EXAMPLE = "first-block:0.1, mag:ratios=flux, taylorseer:2,lite, sea:0.3"
_ADAPTER: TypeAdapter = TypeAdapter(CacheSetting)


def parse_cache(text: str, flag: str = "--cache") -> CacheSetting:
    """`KIND[:PARAMS]` (module docstring) as its validated model; a bad one is a CacheSpecError, one line."""
    kind, _, params = text.strip().partition(":")
    if kind not in KINDS:
        raise CacheSpecError(f"{flag} {text!r}: unknown cache {kind!r}; give one of {', '.join(KINDS)}, with "
                             f"parameters after a colon (e.g. {EXAMPLE})")
    fields = {"kind": kind}
    for item in (p.strip() for p in params.split(",") if p.strip()) if params else ():
        key, value = _param(kind, item, text, flag)
        if key in fields:
            raise CacheSpecError(f"{flag} {text!r}: {key} is given twice")
        fields[key] = value
    try:
        return _ADAPTER.validate_python(fields)
    except ValidationError as exc:
        raise CacheSpecError(f"{flag} {text!r}: {_first_error(exc)}") from None


def _param(kind: str, item: str, text: str, flag: str) -> tuple[str, object]:
    """One `key=value`, bare main value or bare flag of KIND's parameters, the value read from its text."""
    key, eq, value = item.partition("=")
    if not eq:
        if key in FLAGS.get(kind, ()):
            return key, True
        key, value = MAIN[kind], item
    key = key.strip().replace("-", "_")
    known = [k for k in KINDS[kind].model_fields if k != "kind"]
    if key not in known:
        raise CacheSpecError(f"{flag} {text!r}: {kind} takes {', '.join(known)}; {key!r} is not one of them")
    if key == "ratios":
        return key, _ratios(value.strip(), text, flag)
    return key, value.strip()


def _ratios(value: str, text: str, flag: str) -> object:
    """`flux`, or a JSON file holding a list of numbers (a path)."""
    if value == "flux":
        return value
    path = Path(value).expanduser()
    raw = read_bounded(path, f"{flag} {text!r}: ratios={value}", MAX_RATIOS_BYTES, CacheSpecError,
                       "it is neither 'flux' nor a readable JSON file of a list of numbers")  # not a FIFO or /dev/zero
    try:
        data = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise CacheSpecError(f"{flag} {text!r}: ratios={value} is neither 'flux' nor a readable JSON file of a list of "
                             f"numbers ({type(exc).__name__})") from None
    if not isinstance(data, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and
                                            math.isfinite(x) for x in data) or not data:
        raise CacheSpecError(f"{flag} {text!r}: {value} holds no list of numbers (the ratios, one a step)")
    return data


def _first_error(exc: ValidationError) -> str:
    """The first of pydantic's errors as words: the field and what it must be."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"][1:] if not isinstance(p, int))
    msg = err["msg"].removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg


def cache_label(setting: CacheSetting) -> str:
    """The setting as `--cache` takes it back, every parameter that differs from the default named."""
    defaults = type(setting).model_construct()  # (unvalidated: MagCache's default names no ratios)
    parts = []
    for key, value in setting.model_dump(exclude={"kind"}).items():
        if getattr(defaults, key) == value:
            continue
        if key == "ratios" and isinstance(value, list):
            value = f"[{len(value)} values]"
        parts.append(key if value is True else f"{key}={value}")
    return setting.kind + (":" + ",".join(parts) if parts else "")
