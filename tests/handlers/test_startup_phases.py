"""The cold-start timeline's kernels and graphs phases, through the real loader and load_snapshot: the runner
is made to do on the CPU what it does on CUDA (warm the Triton kernels, under the interpreter, and capture the
decode graphs, each "replay" re-running the step), and the phases land between mapped and ready with what they
measured; the kernels are kept in the snapshot cache."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

import warmstart.runtime.kernels
from tests.support.graphs import RerunBackend
from tests.support.serving import build_tiny_snapshot, ready_state
from warmstart.runtime.engine.model_runner import ModelRunner


def test_kernel_and_graph_phases_come_between_mapped_and_ready(
    tmp_path: pathlib.Path, tiny_model_dir: Callable[[str], pathlib.Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs here only where there is no GPU (conftest sets TRITON_INTERPRET)")
    snap = build_tiny_snapshot(tiny_model_dir("llama"), tmp_path)
    monkeypatch.setenv("WARMSTART_KERNELS", "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", "")  # restored after the test: the engine sets it
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setattr(warmstart.runtime.kernels, "_carried_base", None)
    original = ModelRunner.__init__

    def as_on_cuda(self: ModelRunner, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.warm_up_kernels()
        self.capture_decode_graphs((1, 2, 4), budget_s=0.0, backend=RerunBackend())

    monkeypatch.setattr(ModelRunner, "__init__", as_on_cuda)
    state = ready_state(snap)
    timeline = state.timeline.as_dict()
    order = list(timeline["phases"])
    assert order.index("mapped") < order.index("kernels") < order.index("graphs") < order.index("ready")
    kernels, graphs = timeline["details"]["kernels"], timeline["details"]["graphs"]
    assert kernels["seconds"] > 0 and kernels["compiled"] == 0  # the interpreter compiles nothing
    assert pathlib.Path(kernels["cache_dir"]).parent == snap.cache / "kernels"
    assert graphs["batch_sizes"] == [1] and graphs["deferred"] == [2, 4] and graphs["seconds"] > 0
    state.shutdown()
