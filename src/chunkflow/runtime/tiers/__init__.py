"""Where a block's bytes live: one module per tier behind one interface (runtime/tiers/base.py), and their registry.

`TIERS` maps a tier's name to its class, in the order the handle asks them to take a block (the first that claims it
holds its tail); the host tier, which takes every block, is last. Adding a tier is its module and one `register_tier`
call: the handle, streamer, layout and fill code only ever see the interface. `PARK_HOMES` does the same for where a
parked module's non-block tensors live (runtime/parking.py). A tier holds bytes and does not ask what they are: a
codec is a layer over the tiers (runtime/codecs/layer.py). files.py, hostcopies.py and keyed.py are helpers some tiers
share, not tiers.
"""

from __future__ import annotations

from chunkflow.runtime.tiers.base import ParkHome, Tier
from chunkflow.runtime.tiers.disk import DiskParking, DiskTier
from chunkflow.runtime.tiers.host import HostParking, HostTier
from chunkflow.runtime.tiers.shared import SharedHostTier, SharedParking

TIERS: dict[str, type[Tier]] = {"disk": DiskTier, "shared": SharedHostTier, "host": HostTier}
# asked in this order for a park_to: the first home that takes it holds the parked tensors (shared before host)
PARK_HOMES: dict[str, type[ParkHome]] = {"shared": SharedParking, "host": HostParking, "disk": DiskParking}


def register_tier(cls: type[Tier], before: str = "host") -> None:
    """Add a tier class under `cls.name`, asked before the tier named `before` (default: before the host tier, which
    takes whatever is left)."""
    items = [(k, v) for k, v in TIERS.items() if k != cls.name]
    at = next((i for i, (k, _) in enumerate(items) if k == before), len(items))
    items.insert(at, (cls.name, cls))
    TIERS.clear()
    TIERS.update(items)


def unregister_tier(name: str) -> None:
    if name == "host":
        raise ValueError("the host tier takes every block no other tier takes; it cannot be removed")
    TIERS.pop(name, None)


def tiers_for(cfg, module, n_blocks: int, source) -> list[Tier]:
    """The tiers an offload with setting `cfg` uses, in the order they claim blocks (the host tier last)."""
    out = [t for cls in TIERS.values() if (t := cls.for_setting(cfg, module, n_blocks, source)) is not None]
    return out


def park_home(park_to: str, source, cfg=None) -> ParkHome:
    """Where a parked module's non-block tensors go: the first home of PARK_HOMES that takes `park_to` under the
    setting `cfg` ('host': one copy the ranks of a host share where they do, else this process's own)."""
    from chunkflow.runtime.errors import OffloadError

    if park_to not in PARK_HOMES:
        raise OffloadError(f"park_to={park_to!r}: not a place a parked module's tensors can live; one of "
                           f"{', '.join(map(repr, PARK_HOMES))}")
    return next(h for cls in PARK_HOMES.values() if (h := cls.for_setting(park_to, source, cfg)) is not None)
