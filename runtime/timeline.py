"""A start-up's phases on one clock: when each ended, with what it did.

The loader, the engine's model runner and the server mark their phases into Timelines; every mark is a
time.monotonic() reading, and seconds are counted from the timeline's origin only when they are shown, so
marks made in different layers and threads (and copied from one timeline into another) line up exactly.
No torch here: the server imports this before it listens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class Timeline:
    def __init__(
        self, emit: Callable[[dict[str, Any]], None] | None = None, start: float | None = None, origin: str = "start",
    ) -> None:  # fmt: skip
        """``start``: the origin's time.monotonic() reading (now by default), recorded as the phase ``origin``;
        ``emit`` gets each later mark as one record (the serve command's JSON log)."""
        self.start = time.monotonic() if start is None else start
        self.origin = origin
        self.marks: dict[str, float] = {origin: self.start}  # phase -> time.monotonic() when it ended
        self.details: dict[str, dict[str, Any]] = {}
        self._emit = emit or (lambda _: None)
        self._lock = threading.Lock()

    def mark(self, phase: str, at: float | None = None, **details: Any) -> bool:
        """Record that ``phase`` ended at monotonic time ``at`` (now by default); only the first mark counts.

        Returns whether this call was the first. ``details`` (bytes pulled, the URL...) go with it."""
        if phase in self.marks:  # the hot path for first_request / first_token once they are known
            return False
        with self._lock:
            if phase in self.marks:
                return False
            when = time.monotonic() if at is None else at
            self.marks[phase] = when
            if details:
                self.details[phase] = details
        self._emit({"event": "cold_start", "phase": phase, "seconds": round(when - self.start, 4), **details})
        return True

    def add_details(self, phase: str, **details: Any) -> None:
        """More of what a marked phase did, learnt after it ended (the other ranks' pull and map times)."""
        with self._lock:
            self.details[phase] = {**self.details.get(phase, {}), **details}

    def take(self, other: Timeline) -> None:
        """Mark the phases of ``other`` (not its origin) here, at the times and with the details they have there."""
        for phase, when in sorted(other.marks.items(), key=lambda kv: kv[1]):
            if phase != other.origin:
                self.mark(phase, at=when, **other.details.get(phase, {}))

    def between(self, first: str, then: str) -> float:
        return self.marks[then] - self.marks[first]

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def as_dict(self) -> dict[str, Any]:
        """Phases in the order they happened, in seconds since the origin, with their details."""
        with self._lock:
            marks = sorted(self.marks.items(), key=lambda kv: kv[1])
            return {"phases": {k: round(v - self.start, 4) for k, v in marks},
                    "details": {k: dict(v) for k, v in self.details.items()}}
