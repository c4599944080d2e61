"""runtime.timeline: one clock for every layer's phases, so that a timeline taken into another keeps its times."""

from __future__ import annotations

import time

from warmstart.runtime.timeline import Timeline


def test_a_phase_is_marked_once_and_emitted_with_its_details() -> None:
    records: list[dict[str, object]] = []
    timeline = Timeline(records.append, start=100.0, origin="process_start")
    assert timeline.mark("manifest", at=101.5, snapshot_id="abc")
    assert not timeline.mark("manifest", at=109.0)
    assert timeline.marks["manifest"] - timeline.start == 1.5 and "blobs" not in timeline.marks
    assert records == [{"event": "cold_start", "phase": "manifest", "seconds": 1.5, "snapshot_id": "abc"}]
    assert timeline.as_dict() == {"phases": {"process_start": 0.0, "manifest": 1.5},
                                  "details": {"manifest": {"snapshot_id": "abc"}}}


def test_taken_phases_keep_their_clock_times_whatever_the_origins() -> None:
    """The loader's timeline begins after the server's (later still under tensor parallelism, once the ranks have
    met): its phases land in the server's at the moments they happened, not at offsets from the wrong origin."""
    server = Timeline(start=10.0, origin="process_start")
    load = Timeline(start=14.0, origin="load_start")
    load.mark("manifest", at=14.25)
    load.mark("mapped", at=16.0, ranks=[{"rank": 0}])
    load.add_details("mapped", bytes=3)
    server.take(load)
    assert server.as_dict()["phases"] == {"process_start": 0.0, "manifest": 4.25, "mapped": 6.0}
    assert server.details["mapped"] == {"ranks": [{"rank": 0}], "bytes": 3}
    assert load.between("manifest", "mapped") == 1.75


def test_marks_default_to_now() -> None:
    timeline = Timeline()
    before = time.monotonic()
    timeline.mark("ready")
    assert before <= timeline.marks["ready"] <= time.monotonic()
    assert timeline.elapsed() >= timeline.as_dict()["phases"]["ready"]
