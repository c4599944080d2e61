"""Mapped snapshot tensors onto an accelerator: chunked reads into pinned staging buffers, each chunk copied to
the device on a side stream while the next one is read from the mapping (and, cold, from disk).

Two staging buffers alternate; a buffer is refilled only after the event recorded behind its last copy has
fired, so reads and host-to-device copies overlap without a chunk ever being overwritten in flight. On the
CPU the mapped views are already where the engine runs them, and nothing is copied.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_BYTES = 32 << 20


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
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    cuda = pinned and torch.cuda.is_available()
    stream = torch.cuda.Stream() if cuda else None
    staging = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
    in_flight: list[torch.cuda.Event | None] = [None, None]
    turn = 0
    for name, source in sources.items():
        src = source.contiguous().reshape(-1).view(torch.uint8)
        dst = destinations[name].reshape(-1).view(torch.uint8)
        if src.numel() != dst.numel():
            raise ValueError(f"{name}: {src.numel()} bytes to copy into {dst.numel()}")
        for start in range(0, src.numel(), chunk_bytes):
            n = min(chunk_bytes, src.numel() - start)
            buffer, event = staging[turn], in_flight[turn]
            if event is not None:
                event.synchronize()
            buffer[:n].copy_(src[start : start + n])
            if stream is not None:
                with torch.cuda.stream(stream):
                    dst[start : start + n].copy_(buffer[:n], non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(stream)
                    in_flight[turn] = done
            else:
                dst[start : start + n].copy_(buffer[:n])
            turn ^= 1
    if stream is not None:
        stream.synchronize()
