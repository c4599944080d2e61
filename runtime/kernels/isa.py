"""Which instruction set the CPU kernels run, decided in one place (runtime/kernels/isa.h has the levels).

Every C extension probes the CPU when it is imported; this module sets them all to one level: the best the CPU has,
or a lower one named by ``WARMSTART_CPU_ISA`` (portable, avx2, avx512, avx512_bf16), so that an AVX-512 machine can
run, and test, the paths an AVX2 or an ARM machine takes. ``lowered`` does the same for a block of code (tests).
Callers ask ``at_least``, never the CPU, so that a lowered level is honoured everywhere.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from types import ModuleType

ISA_ENV = "WARMSTART_CPU_ISA"
LEVELS = ("portable", "avx2", "avx512", "avx512_bf16")
_EXTENSIONS = ("_cpu_attention", "_cpu_gemv", "_cpu_lora", "_cpu_small_ops")


def _load() -> list[ModuleType]:
    loaded = []
    for name in _EXTENSIONS:
        with contextlib.suppress(ImportError):  # built by setup.py; absent where the install had no C compiler
            loaded.append(importlib.import_module(f"runtime.kernels.{name}"))
    return loaded


_extensions = _load()
_BEST = min((LEVELS.index(ext.best_isa()) for ext in _extensions), default=0)


def best() -> str:
    """The best level this CPU has (portable where no extension was built)."""
    return LEVELS[_BEST]


def _from_env() -> str:
    name = os.environ.get(ISA_ENV) or best()
    if name not in LEVELS:
        raise ValueError(f"{ISA_ENV}={name!r} is not one of {', '.join(LEVELS)}")
    if LEVELS.index(name) > _BEST:
        raise ValueError(f"{ISA_ENV}={name}: this CPU has at most {best()}; name that or a lower level")
    return name


_chosen = _from_env()


def _apply(name: str) -> None:
    global _chosen
    for ext in _extensions:
        ext.isa(name)
    _chosen = name


_apply(_chosen)


def chosen() -> str:
    """The level the kernels run at."""
    return _chosen


def at_least(level: str) -> bool:
    """Whether the kernels may use ``level``'s instructions."""
    return LEVELS.index(_chosen) >= LEVELS.index(level)


@contextlib.contextmanager
def lowered(name: str) -> Iterator[None]:
    """Run the kernels at ``name`` (at most ``best()``) inside the block."""
    if name not in LEVELS or LEVELS.index(name) > _BEST:
        raise ValueError(f"{name!r} is not a level this CPU has (it has up to {best()})")
    before = _chosen
    _apply(name)
    try:
        yield
    finally:
        _apply(before)
