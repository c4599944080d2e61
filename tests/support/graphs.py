"""A stand-in for CUDA graph capture on the CPU (see runtime.engine.cuda_graphs.GraphBackend): its "replay" runs
the recorded step again into the tensor the capture returned, as a graph's replay rewrites its static output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class RerunBackend:
    def __init__(self, on_warm_up: Callable[[], None] | None = None) -> None:
        self.replays = 0
        self.on_warm_up = on_warm_up or (lambda: None)

    def warm_up(self, step: Callable[[], torch.Tensor]) -> None:
        self.on_warm_up()
        step()

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]:
        out = step()

        def replay() -> None:
            self.replays += 1
            out.copy_(step())

        return replay, out


class AddressBackend:
    """Capture as a CUDA graph sees it: the tensors a step reads are fixed by their addresses, so any storage it
    read but did not make itself must outlive the capture. Records those storages weakly and keeps no reference
    to the step (a real graph keeps none); ``dropped()`` lists the ones freed since, which a replay would read
    after the allocator handed their memory to someone else."""

    def __init__(self) -> None:
        self.read: dict[Any, str] = {}  # weak storage reference -> the first op that read it

    def warm_up(self, step: Callable[[], torch.Tensor]) -> None:
        step()

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]:
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        read, made = self.read, set[Any]()

        class Reads(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                for t in tree_leaves((args, kwargs)):
                    if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                        ref = StorageWeakRef(t.untyped_storage())
                        if ref not in made:
                            read.setdefault(ref, str(func))
                out = func(*args, **(kwargs or {}))
                outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
                made.update(StorageWeakRef(t.untyped_storage()) for t in outs)
                return out

        with Reads():
            out = step()
        return (lambda: None), out

    def dropped(self) -> list[str]:
        return [op for ref, op in self.read.items() if ref.expired()]
