"""The disk tier lives in runtime/tiers/disk.py; its errors and warning, importable from here as before."""

from chunkflow.runtime.tiers.disk import DiskTier, DiskTierError, DiskTierWarning

__all__ = ["DiskTier", "DiskTierError", "DiskTierWarning"]
