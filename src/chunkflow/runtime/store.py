"""The host store: one allocation holding every offloaded block's bytes, pinned in place.

PyTorch's caching host allocator (`pin_memory=True`) rounds each allocation up to a power of two, so pinning
block by block can lock 1.5-2x the weight bytes. Here the bytes live in ONE pageable allocation that is then
page-locked with cudaHostRegister: pinned bytes equal the store size exactly (the packed blocks plus at most
ALIGN-1 bytes of padding per tensor). Without CUDA the store is plain host memory and nothing is pinned.
"""

from __future__ import annotations

import torch

from chunkflow_planner.errors import ChunkflowError


class HostStoreError(ChunkflowError):
    pass


class HostStore:
    def __init__(self, nbytes: int, pin: bool):
        self.nbytes = nbytes
        self.data = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self.pinned_bytes = 0
        if pin and nbytes > 0:
            self._register()

    def _register(self) -> None:
        cudart = torch.cuda.cudart()
        # portable: page-locked for every CUDA context of the process (a store read by a reader thread, a rank's GPU)
        ret = cudart.cudaHostRegister(self.data.data_ptr(), self.nbytes, 1)
        if int(ret) != 0:
            raise HostStoreError(
                f"cudaHostRegister of {self.nbytes} bytes failed (cudaError {int(ret)}); the host may be short of "
                "lockable memory (check `ulimit -l` and free RAM), or use a smaller model / more residency"
            )
        self.pinned_bytes = self.nbytes

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.data[offset : offset + nbytes]

    def release(self) -> None:
        """Unregister (if pinned) and drop the bytes. Callers make sure no copy still reads them."""
        if self.pinned_bytes:
            ret = torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())
            self.pinned_bytes = 0
            if int(ret) != 0:
                raise HostStoreError(f"cudaHostUnregister failed (cudaError {int(ret)})")
        self.data = torch.empty(0, dtype=torch.uint8)
        self.nbytes = 0
