"""Where the engine runs: a device name resolved once (``auto``, ``cpu``, ``cuda``, ``cuda:N``), and what a CUDA
device's memory leaves for the KV pool.

A device that cannot be had is refused by ``resolve_device`` before anything is loaded, with one sentence
saying what torch sees and what to ask for instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_NAME = re.compile(r"(auto|cpu|cuda)(:(\d+))?")

GIB = 1 << 30


class DeviceError(ValueError):
    """A device that does not exist here; the message says what torch sees and what to use instead."""


def check_device_name(name: str) -> str:
    """``name`` if it is one of auto, cpu, cuda, cuda:N (checked without asking torch anything), else
    DeviceError."""
    match = _NAME.fullmatch(name.strip().lower())
    if match is None or (match.group(2) and match.group(1) != "cuda"):
        raise DeviceError(f"unknown device {name[:40]!r}; use {DEVICE_CHOICES}")
    return match.group(0)


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """The device ``name`` asks for, with its index: ``auto`` is the current CUDA device when torch sees one,
    else the CPU; ``cuda`` is the current CUDA device. A CUDA device torch does not see is a DeviceError."""
    if isinstance(name, torch.device):
        name = str(name)
    name = check_device_name(name)
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise DeviceError(f"device {name!r} was asked for, but torch {torch.__version__} ({build}) sees no CUDA "
                          "device on this machine; use device 'cpu', or 'auto' to take a GPU only where there is one")
    index = int(name.split(":")[1]) if ":" in name else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        seen = ", ".join(f"cuda:{i}" for i in range(count))
        raise DeviceError(f"device {name!r} was asked for, but torch sees {count} CUDA device(s) here ({seen}); "
                          "pick one of those, or 'cuda' for the current one")
    return torch.device("cuda", index)


def describe_device(device: torch.device) -> str:
    """``cpu``, or ``cuda:0 (NVIDIA H200, 139.8 GiB)``: for logs and /status."""
    if device.type != "cuda":
        return str(device)
    props = torch.cuda.get_device_properties(device)
    return f"{device} ({props.name}, {props.total_memory / GIB:.1f} GiB)"


@dataclass
class CudaMemory:
    """What the KV pool may take on a CUDA device, and the figures it came from (bytes)."""

    total: int
    free: int
    held: int  # by this process's tensors (the weights) and torch's cache
    reserve: int  # kept for activations, CUDA graphs and workspaces
    utilization: float

    @property
    def budget(self) -> int:
        """vLLM's rule: this instance may use ``utilization`` of the GPU's total memory; what it holds and the
        reserve come off that. Never more than is free beside the reserve: other processes' memory is not ours."""
        return max(0, min(int(self.total * self.utilization) - self.held - self.reserve, self.free - self.reserve))

    def explain(self) -> str:
        return (f"gpu_memory_utilization {self.utilization:g} of {self.total / GIB:.2f} GiB is "
                f"{self.total * self.utilization / GIB:.2f} GiB, less {self.held / GIB:.2f} GiB held (weights) and "
                f"{self.reserve / GIB:.2f} GiB kept for activations; {self.free / GIB:.2f} GiB is free")


def cuda_memory(device: torch.device, utilization: float, reserve: int) -> CudaMemory:
    """The device's memory as the KV pool sees it, measured after the weights are on it."""
    torch.cuda.empty_cache()  # blocks torch cached but no tensor uses would count as held
    free, total = torch.cuda.mem_get_info(device)
    return CudaMemory(total=total, free=free, held=torch.cuda.memory_reserved(device), reserve=reserve,
                      utilization=utilization)
