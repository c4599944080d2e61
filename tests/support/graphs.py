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
