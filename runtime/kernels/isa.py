"""Which instruction set the CPU kernels run, decided in one place (runtime/kernels/isa.h has the levels).

Every C extension probes the CPU when it is imported; this module sets them all to one level: the best the CPU has,
or a lower one named by ``WARMSTART_CPU_ISA`` (portable, avx2, avx512, avx512_bf16), so that an AVX-512 machine can
run, and test, the paths an AVX2 or an ARM machine takes. The variable never raises the level: one above what the
CPU has runs at the CPU's best, with a warning (a fleet of mixed machines can share one setting); a name that is not
a level is refused. ``lowered`` does the same for a block of code (tests).
Callers ask ``at_least``, never the CPU, so that a lowered level is honoured everywhere.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
from collections.abc import Iterator
from types import ModuleType

import torch

log = logging.getLogger(__name__)

ISA_ENV = "WARMSTART_CPU_ISA"
LEVELS = ("portable", "avx2", "avx512", "avx512_bf16")
_EXTENSIONS = ("_cpu_attention", "_cpu_gemv", "_cpu_lora", "_cpu_small_ops")


def _load() -> list[ModuleType]:
    loaded = []
    for name in _EXTENSIONS:
        with contextlib.suppress(ImportError):  # built by setup.py; absent where the install had no C compiler
            loaded.append(importlib.import_module(f"{__package__}.{name}"))
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
        log.warning("%s=%s: this CPU has at most %s, which the kernels run at", ISA_ENV, name, best())
        return best()
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


def available() -> tuple[str, ...]:
    """The levels up to the chosen one: every path the kernels take here (tests run each)."""
    return LEVELS[: LEVELS.index(_chosen) + 1]


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


@functools.cache
def onednn_packs_bf16() -> bool:
    """Whether oneDNN packs bf16 weights here: its own check, which ONEDNN_MAX_CPU_ISA lowers too (on AVX2 it raises
    "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq")."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True
