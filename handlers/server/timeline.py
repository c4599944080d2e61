"""The cold start as a timeline: when each phase of this process's start-up ended, in seconds since it began.

Phases, in the order they happen: process_start (0), imports (what serving needs before it can listen),
listening (the socket is bound and answers /health), build (only when serve was given an HF model directory:
its snapshot built into the store, in the loading thread), runtime_imports (torch and the loader, in the
loading thread), manifest, blobs (present in the local cache, pulled or already there), device_copy (on a
GPU: the weights are on it; with the bytes, the seconds spent copying and GB/s), mapped (the weights are in
place), kernels (on the Triton path: every kernel of a prefill and a decode step called once, compiled or
loaded from the carried cache; with the seconds and how many kernels were compiled and how many carried),
graphs (on CUDA: the decode graphs captured before serving, with the seconds, the batch sizes captured and
those deferred until traffic needs them or the engine idles), ready (the engine takes requests and /health
says 200; with the device and the ops it runs), first_request, first_token. Each phase is marked once, into one
runtime.timeline.Timeline that the loader and the engine mark too; every mark is one JSON line for logs and
scripts, and the whole timeline is served at /status.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from warmstart.runtime.timeline import Timeline

PHASES = (
    "process_start",
    "imports",
    "listening",
    "build",
    "runtime_imports",
    "manifest",
    "blobs",
    "device_copy",
    "mapped",
    "kernels",
    "graphs",
    "ready",
    "first_request",
    "first_token",
)

_IMPORTED_AT = time.monotonic()


def process_start() -> float:
    """When this process started, on the time.monotonic() clock.

    The kernel records the start in clock ticks since boot, and CLOCK_BOOTTIME counts from the same
    origin, so the interpreter's own start-up is counted too (10 ms resolution). Elsewhere, the import
    of this module is the earliest moment known."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_after_boot
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED_AT
    now = time.monotonic()
    return now - age if 0 <= age < 3600 else _IMPORTED_AT


_print_lock = threading.Lock()


def print_json_line(record: dict[str, Any]) -> None:
    """The serve command's log: one JSON object per line on stdout, flushed at once for whoever waits on it.
    The loading thread and the event loop both log; the lock keeps their lines whole."""
    line = json.dumps(record) + "\n"
    with _print_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


def cold_start_timeline(emit: Callable[[dict[str, Any]], None] | None = None) -> Timeline:
    """This process's cold start: its origin is when the process started (phase process_start)."""
    return Timeline(emit, start=process_start(), origin="process_start")
