"""A helper of the park homes (not a tier): a parked module's non-block tensors copied into one host allocation
(`HostCopies`), the host park home's way (runtime/tiers/host.py) and where the disk and shared homes keep what
their files or segment cannot hold."""

from __future__ import annotations

import torch

from chunkflow.runtime.store import HostStore


class HostCopies:
    """A parked module's non-block tensors in host memory: one allocation (pinned on CUDA), kept for the next park,
    where a tensor not written since the last unpark is not copied again. The host park home is this; the other
    homes keep here what they cannot hold."""

    def __init__(self):
        self.store: HostStore | None = None  # host homes of the non-block tensors while parked
        self.store_device: torch.device | None = None  # the device the store's tensors were copied to and from
        self.versions: list[tuple[int, int]] | None = None  # (version, data_ptr) of each at the last unpark

    def attach(self, handle) -> None:
        self.versions = None  # new non-block tensors: each is copied at the next park

    def stats(self) -> dict:
        return {}

    def close(self, handle, restore: bool) -> None:
        """Nothing beyond the store (`release_store`)."""

    def release_store(self) -> None:
        """Free the park store (the next park makes another), once any copy out of it has finished."""
        if self.store is not None:
            if self.store_device is not None and self.store_device.type == "cuda":
                torch.cuda.synchronize(self.store_device)
            self.store.release()
            self.store = None

    def park(self, tensors, device: torch.device) -> None:
        views = self._views(tensors, device)
        with torch.no_grad(), torch.inference_mode(False):
            for t, host, version in zip(tensors, views, self.versions or [None] * len(views)):
                cur = t.get()
                if version is None or (cur._version, cur.data_ptr()) != version or cur.device == host.device:
                    host.copy_(cur.detach())
                if t.is_param:
                    cur.data = host
                else:
                    t.set_buffer(host)

    def _views(self, tensors, device: torch.device) -> list[torch.Tensor]:
        """Host homes of the non-block tensors while parked: views of one host allocation (pinned on CUDA)."""
        sizes = [t.get().numel() * t.get().element_size() for t in tensors]
        offsets, total = [], 0
        for n in sizes:
            total = -(-total // 256) * 256
            offsets.append(total)
            total += n
        if self.store is None or self.store.nbytes != total:
            if self.store is not None:
                self.store.release()
            self.store = HostStore(total, pin=device.type == "cuda")
            self.store_device = device
            self.versions = None
        out = []
        for t, off, n in zip(tensors, offsets, sizes):
            cur = t.get()
            out.append(self.store.alias(off, n).view(cur.dtype).view(cur.shape))
        return out

    def unpark(self, tensors, device: torch.device) -> None:
        versions = []
        with torch.no_grad(), torch.inference_mode(False):
            for t in tensors:
                cur = t.get()
                dev = cur.detach().to(device, non_blocking=device.type == "cuda", copy=True)
                if t.is_param:
                    cur.data = dev
                else:
                    t.set_buffer(dev)
                versions.append((t.get()._version, t.get().data_ptr()))
        self.versions = versions
