"""The WARMSTART_CPU_... switches every CPU kernel reads (runtime/kernels/switches.py)."""

from __future__ import annotations

import pytest

from warmstart.runtime.kernels.switches import kernel_chosen


def test_unset_or_empty_or_kernel_keeps_the_kernel_and_torch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WARMSTART_CPU_TEST", raising=False)
    assert kernel_chosen("WARMSTART_CPU_TEST")
    for value, chosen in (("", True), ("kernel", True), ("torch", False)):
        monkeypatch.setenv("WARMSTART_CPU_TEST", value)
        assert kernel_chosen("WARMSTART_CPU_TEST") is chosen


def test_anything_else_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARMSTART_CPU_TEST", "Torch")
    with pytest.raises(ValueError, match="WARMSTART_CPU_TEST='Torch' is not one of kernel, torch"):
        kernel_chosen("WARMSTART_CPU_TEST")
