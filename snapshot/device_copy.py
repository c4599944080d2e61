"""Mapped snapshot blobs onto an accelerator: chunked reads into pinned staging buffers, each chunk copied to
the device on a side stream while the next one is read from the mapping (and, cold, from disk).

Two staging buffers alternate; a buffer is refilled only after the event recorded behind its last copy has
fired, so reads and host-to-device copies overlap without a chunk ever being overwritten in flight. Host
memory holds the two buffers and the page cache, never a copy of the model. On the CPU the mapped views are
already where the engine runs them, and nothing is copied (``BlobCopier`` still copies when asked to, which is
how tests and the CPU exercise this path).

``BlobCopier`` copies whole blobs (a snapshot has one per decoder layer) on a thread of its own as they land in
the cache, so that the first layers are on the device while the last are still downloading.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

DEFAULT_CHUNK_BYTES = 32 << 20


class Stager:
    """Copies flat uint8 tensors from host memory into device memory through two staging buffers."""

    def __init__(self, device: torch.device, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.cuda = device.type == "cuda"
        # Made on the thread that copies: the stream belongs to ``device``, the buffers are pinned for it.
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2)]
        self.in_flight: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Queue the copy of ``src`` into ``dst`` (both flat uint8); it is complete after ``synchronize``."""
        if src.numel() != dst.numel():
            raise ValueError(f"{src.numel()} bytes to copy into {dst.numel()}")
        chunk = self.buffers[0].numel()
        for start in range(0, src.numel(), chunk):
            n = min(chunk, src.numel() - start)
            buffer, event = self.buffers[self.turn], self.in_flight[self.turn]
            if event is not None:
                event.synchronize()  # the copy out of this buffer has finished
            buffer[:n].copy_(src[start : start + n])
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    dst[start : start + n].copy_(buffer[:n], non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(self.stream)
                    self.in_flight[self.turn] = done
            else:
                dst[start : start + n].copy_(buffer[:n])
            self.turn ^= 1

    def synchronize(self) -> None:
        """Wait until every queued copy has landed; the destinations may then be read on any stream."""
        if self.stream is not None:
            self.stream.synchronize()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def copy_to_device(
    tensors: dict[str, torch.Tensor], device: str | torch.device, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> dict[str, torch.Tensor]:
    device = torch.device(device)
    if device.type == "cpu":
        return tensors
    destinations = {name: torch.empty_like(t, device=device) for name, t in tensors.items()}
    staged_copy(tensors, destinations, chunk_bytes, pinned=device.type == "cuda")
    return destinations


def staged_copy(
    sources: dict[str, torch.Tensor], destinations: dict[str, torch.Tensor], chunk_bytes: int, pinned: bool
) -> None:
    """Copy every source into its destination through two alternating staging buffers of ``chunk_bytes``."""
    cuda = pinned and torch.cuda.is_available()
    device = next((d.device for d in destinations.values() if d.device.type == "cuda"), None) if cuda else None
    stager = Stager(device or torch.device("cpu"), chunk_bytes)
    for name, source in sources.items():
        src, dst = as_bytes(source), destinations[name].reshape(-1).view(torch.uint8)
        if src.numel() != dst.numel():
            raise ValueError(f"{name}: {src.numel()} bytes to copy into {dst.numel()}")
        stager.copy(src, dst)
    stager.synchronize()


@dataclass
class CopyStats:
    bytes: int = 0
    blobs: int = 0
    seconds: float = 0.0  # spent copying (reading the mapping, and the transfers), not waiting for blobs
    first_started: float | None = None  # time.monotonic()
    last_done: float | None = None

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {"bytes": self.bytes, "blobs": self.blobs, "seconds": round(self.seconds, 4),
                "gb_per_s": round(self.gb_per_s, 3)}


class BlobCopier:
    """Copies whole blobs to ``device`` on a thread of its own, each as soon as it is ``ready`` (in the cache).

    ``open_blob(blob, size)`` maps a cached blob as a flat uint8 tensor; ``want`` names the blobs to copy, with
    their sizes (others reported ready are ignored); ``finish`` waits for the last copy and returns each blob's
    device tensor, on which the loader makes the same views it would make over the mapping.
    """

    def __init__(self, device: torch.device, open_blob: Callable[[str, int], torch.Tensor],
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:  # fmt: skip
        self.device = device
        self.open_blob = open_blob
        self.chunk_bytes = chunk_bytes
        self.stats = CopyStats()
        self.copied: dict[str, torch.Tensor] = {}
        self.sizes: dict[str, int] = {}  # the blobs wanted
        self._queued: set[str] = set()
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stopped = False

    def want(self, blobs: Mapping[str, int]) -> None:
        with self._lock:
            self.sizes.update(blobs)

    def ready(self, blob: str) -> None:
        """``blob`` is in the cache and may be copied; safe to call from any thread, more than once."""
        with self._lock:
            if blob not in self.sizes or blob in self._queued or self._stopped:
                return
            self._queued.add(blob)
            self._queue.put(blob)  # under the lock: never behind stop's end marker
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="warmstart-device-copy", daemon=True)
                self._thread.start()

    def finish(self) -> dict[str, torch.Tensor]:
        """Every wanted blob on the device; raises what went wrong while copying."""
        for blob in sorted(set(self.sizes) - self._queued):
            self.ready(blob)
        self.stop()
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self.copied

    def stop(self) -> None:
        """No more blobs: the thread ends after the ones queued (a load that failed calls this and goes on)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._queue.put(None)

    def _run(self) -> None:
        stager: Stager | None = None
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # the current device is per thread
            stager = Stager(self.device, self.chunk_bytes)
        except BaseException as e:  # noqa: BLE001 (re-raised by finish on the caller's thread)
            self._error = e
        while (blob := self._queue.get()) is not None:
            if stager is None or self._error is not None:
                continue  # drain the queue; finish raises the first error
            try:
                self._copy(stager, blob)
            except BaseException as e:  # noqa: BLE001
                self._error = e
        if stager is not None and self._error is None:
            started = time.monotonic()
            stager.synchronize()
            self.stats.seconds += time.monotonic() - started
            self.stats.last_done = time.monotonic()

    def _copy(self, stager: Stager, blob: str) -> None:
        started = time.monotonic()
        if self.stats.first_started is None:
            self.stats.first_started = started
        src = self.open_blob(blob, self.sizes[blob])
        dst = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)
        stager.copy(src, dst)
        self.copied[blob] = dst
        self.stats.bytes += src.numel()
        self.stats.blobs += 1
        self.stats.seconds += time.monotonic() - started
