"""The host store: one allocation holding every offloaded block's bytes, pinned in place.

PyTorch's caching host allocator (`pin_memory=True`) rounds each allocation up to a power of two, so pinning
block by block can lock 1.5-2x the weight bytes. Here the bytes live in ONE pageable allocation that is then
page-locked with cudaHostRegister: pinned bytes equal the store size exactly (the packed blocks plus at most
ALIGN-1 bytes of padding per tensor). Without CUDA the store is plain host memory and nothing is pinned.

Page-locking costs about as much as reading the bytes from a fast disk (the kernel maps and locks every page: a few
GB/s). Given `ranges` (the blocks' spans: no copy crosses one), the store is locked span by span on a thread of its
own while the loader writes into it, so the locking overlaps the reads; `wait()` (before any copy from it) joins it
and raises what it met.

A store over a read-only map (`read_only`: a host segment the ranks share, sealed, runtime/hostshare.py) is locked
with cudaHostRegisterReadOnly, which the device must support (cudaDevAttrHostRegisterReadOnlySupported); where it
does not, the registration fails and says so (one copy per rank, CHUNKFLOW_SHARE_HOST=0, pins as before).
"""

from __future__ import annotations

import threading
import time

import torch

from chunkflow_planner.errors import ChunkflowError


class HostStoreError(ChunkflowError):
    pass


REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable: page-locked for every CUDA context of the process
REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the device only reads it (a read-only map must say so)


class PinClock:
    """The process's seconds page-locking host stores: `locked_s` inside cudaHostRegister on any thread, `waited_s`
    of them a caller's thread spent (a lock in the constructor, or waiting for the pinning thread): what the reads
    did not hide. A load reports how much of each its build took (LoadResult.pin_seconds, pin_wait_seconds)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.locked_s = 0.0
        self.waited_s = 0.0

    def add(self, locked_s: float = 0.0, waited_s: float = 0.0) -> None:
        with self._lock:
            self.locked_s += locked_s
            self.waited_s += waited_s

    def now(self) -> tuple[float, float]:
        with self._lock:
            return self.locked_s, self.waited_s


PIN_CLOCK = PinClock()


def own_storage(flat: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 CPU tensor's bytes as a tensor with a storage of its own, aliasing them (through numpy, which
    keeps `flat`'s memory alive as long as the alias lives)."""
    return torch.from_numpy(flat.numpy()) if flat.numel() else flat.clone()


class HostStore:
    def __init__(self, nbytes: int, pin: bool, ranges: list[tuple[int, int]] | None = None,
                 data: torch.Tensor | None = None, read_only: bool = False):
        """`data`: bytes the store lives in (a 1-D uint8 CPU tensor of at least `nbytes`, e.g. a map of a segment
        shared by the ranks of a host, runtime/hostshare.py) instead of an allocation of its own; `read_only`: that
        map is read-only (module docstring)."""
        self.nbytes = nbytes
        self.read_only = read_only
        self.data = torch.empty(max(nbytes, 1), dtype=torch.uint8) if data is None else data
        self.pinned_bytes = 0
        self._registered: list[int] = []  # offsets of the spans registered, each unregistered at release
        self._pinning: threading.Thread | None = None
        self._pin_error: BaseException | None = None
        if pin and nbytes > 0:
            if ranges is None or len(ranges) < 2:
                t0 = time.perf_counter()
                self._register(0, nbytes)
                PIN_CLOCK.add(waited_s=time.perf_counter() - t0)
            else:
                device = torch.cuda.current_device()
                self._pinning = threading.Thread(target=self._register_all, args=(ranges, device),
                                                 name="chunkflow-pin", daemon=True)
                self._pinning.start()

    def _register(self, offset: int, nbytes: int) -> None:
        cudart = torch.cuda.cudart()
        t0 = time.perf_counter()
        # portable: page-locked for every CUDA context of the process (a store read by a reader thread, a rank's GPU)
        flags = REGISTER_PORTABLE | (REGISTER_READ_ONLY if self.read_only else 0)
        ret = cudart.cudaHostRegister(self.data.data_ptr() + offset, nbytes, flags)
        PIN_CLOCK.add(locked_s=time.perf_counter() - t0)
        if int(ret) != 0 and self.read_only:
            raise HostStoreError(
                f"cudaHostRegister of {nbytes} bytes of the host copy the ranks share, read-only, failed (cudaError "
                f"{int(ret)}): this GPU or driver may not page-lock read-only memory "
                "(cudaDevAttrHostRegisterReadOnlySupported), or the host is short of lockable memory (`ulimit -l`); "
                "set CHUNKFLOW_SHARE_HOST=0 to pin one copy per rank")
        if int(ret) != 0:
            raise HostStoreError(
                f"cudaHostRegister of {nbytes} bytes failed (cudaError {int(ret)}); the host may be short of "
                "lockable memory (check `ulimit -l` and free RAM), or use a smaller model / more residency"
            )
        self._registered.append(offset)
        self.pinned_bytes += nbytes

    def _register_all(self, ranges: list[tuple[int, int]], device: int) -> None:
        try:
            torch.cuda.set_device(device)  # this thread's CUDA calls on the caller's GPU (no context on another)
            for offset, nbytes in ranges:
                if nbytes > 0:
                    self._register(offset, nbytes)
        except BaseException as exc:  # raised by wait(), in the caller's thread
            self._pin_error = exc

    def pin_now(self, ranges: list[tuple[int, int]] | None = None) -> None:
        """Page-lock a store made with pin=False now, span by span (`ranges`, else whole): a shared segment once it is
        sealed."""
        t0 = time.perf_counter()
        for offset, nbytes in ranges if ranges else [(0, self.nbytes)]:
            if nbytes > 0:
                self._register(offset, nbytes)
        PIN_CLOCK.add(waited_s=time.perf_counter() - t0)

    def wait(self) -> None:
        """Return once the whole store is page-locked (at once where it was locked in the constructor)."""
        if self._pinning is not None:
            t0 = time.perf_counter()
            self._pinning.join()
            PIN_CLOCK.add(waited_s=time.perf_counter() - t0)
            self._pinning = None
        if self._pin_error is not None:
            exc, self._pin_error = self._pin_error, None
            raise exc

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.data[offset : offset + nbytes]

    def alias(self, offset: int, nbytes: int) -> torch.Tensor:
        """The same bytes as `view`, as a tensor with a storage of its own (nothing copied; it keeps the store's memory
        alive): what a block tensor is outside its forward, so that code grouping tensors by storage (save_pretrained's
        shards, torch.save, safetensors' shared-tensor check) sees each tensor apart, as without offload."""
        return own_storage(self.data[offset : offset + nbytes])

    def release(self) -> None:
        """Unregister (if pinned) and drop the bytes. Callers make sure no copy still reads them."""
        if self._pinning is not None:
            t0 = time.perf_counter()
            self._pinning.join()
            PIN_CLOCK.add(waited_s=time.perf_counter() - t0)
            self._pinning = None
        self._pin_error = None
        failed = []
        for offset in self._registered:
            ret = torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr() + offset)
            if int(ret) != 0:
                failed.append(int(ret))
        self._registered, self.pinned_bytes = [], 0
        if failed:
            raise HostStoreError(f"cudaHostUnregister failed (cudaError {failed[0]})")
        self.data = torch.empty(0, dtype=torch.uint8)
        self.nbytes = 0
