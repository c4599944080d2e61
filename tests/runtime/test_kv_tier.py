"""The KV tier's segment format and its reader/writer threads, over an in-memory backend (the disk and object
store backends are tested in tests/snapshot/test_kv_tier_backends.py)."""

from __future__ import annotations

import hashlib
import hmac
import threading
import time

import pytest
import torch

from warmstart.runtime.engine.block_manager import block_hashes
from warmstart.runtime.engine.kv_tier import MAC_LEN, KVTier, TierCorrupt, TierScope, pack, unpack

SCOPE = TierScope(namespace="default", model="snap1", adapter="", dtype="bfloat16", block_size=4, shape=(2, 1, 8))


class MemoryBackend:
    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.gets: list[str] = []

    def get(self, key: str) -> bytes | None:
        self.gets.append(key)
        return self.objects.get(key)

    def put(self, key: str, data: bytes) -> None:
        self.objects[key] = data


def segment_kv(blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SCOPE.segment_shape(blocks), generator=g).to(torch.bfloat16)


def chain(blocks: int, first: int = 0) -> list[int]:
    return block_hashes(list(range(first, first + blocks * SCOPE.block_size)), SCOPE.block_size)


KEY = b"a key the instances share, 32 b."


def test_a_segment_round_trips_bit_for_bit() -> None:
    hashes, kv = chain(2), segment_kv(2, 0)
    assert torch.equal(unpack(pack(SCOPE, hashes, kv, KEY), SCOPE, hashes, KEY), kv)


def forge(data: bytes) -> bytes:
    """What a forged write did to a version-1 segment: new KV in place of the old, and every unkeyed check made
    to fit (here the MAC is recomputed with a key the forger guesses)."""
    header_len = int.from_bytes(data[4:8], "little")
    signed = data[: 8 + header_len] + bytes(len(data) - MAC_LEN - 8 - header_len)  # the KV zeroed
    return signed + hmac.new(b"a guess at the key, 32 bytes....", signed, hashlib.sha256).digest()


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "other chain", "other scope", "garbage", "old",
                                    "forged", "another key", "unsigned version 1"])
def test_anything_but_the_segment_asked_for_is_refused(damage: str) -> None:
    hashes, kv = chain(2), segment_kv(2, 0)
    data = pack(SCOPE, hashes, kv, b"another key, 16+" if damage == "another key" else KEY,
                written_at=time.time() - (100 if damage == "old" else 0))
    scope, asked = SCOPE, hashes
    if damage == "forged":
        data = forge(data)
    elif damage == "unsigned version 1":
        data = data[:-MAC_LEN]
    elif damage == "flip a payload byte":
        data = data[:-5] + bytes([data[-5] ^ 1]) + data[-4:]
    elif damage == "truncate":
        data = data[:-16]
    elif damage == "other chain":
        asked = chain(2, first=1)
    elif damage == "other scope":
        scope = TierScope("tenant-b", "snap1", "", "bfloat16", 4, (2, 1, 8))
    elif damage == "garbage":
        data = b"WSKV\xff\xff\xff\xff{"
    with pytest.raises(TierCorrupt):
        unpack(data, scope, asked, KEY, max_age_s=10)


def test_scope_separates_tenants_models_adapters_and_layouts() -> None:
    keys = {
        TierScope(ns, model, adapter, dtype, 4, (2, 1, 8)).key(123)
        for ns in ("a", "b") for model in ("m1", "m2") for adapter in ("", "lora1") for dtype in ("bfloat16", "float32")
    }  # fmt: skip
    assert len(keys) == 16


def tier(backend: MemoryBackend, **options: object) -> KVTier:
    return KVTier(backend, SCOPE, segment_blocks=2, key=KEY, **options)  # type: ignore[arg-type]


def test_written_segments_load_back_from_the_first_asked_until_the_first_missing() -> None:
    backend = MemoryBackend()
    t = tier(backend)
    hashes = chain(7)  # three whole segments of two blocks, and one block more
    kvs = [segment_kv(2, s) for s in range(3)]
    for s in (0, 1):  # segment 2 never written
        assert t.save(t.segment_hashes(hashes, s), kvs[s])
    t.close()
    assert t.stats.segments_written == 2 and len(backend.objects) == 2
    t = tier(backend)
    lookup = t.lookup(hashes, first_segment=0)
    assert lookup is not None
    loaded = lookup.future.result(timeout=10)
    assert [torch.equal(a, b) for a, b in zip(loaded, kvs, strict=False)] == [True, True]
    assert len(loaded) == 2 and len(backend.gets) == 3  # segment 2 was asked for and missed
    later = t.lookup(hashes, first_segment=1)
    assert later is not None and len(later.future.result(timeout=10)) == 1
    assert t.lookup(hashes, first_segment=3) is None  # no whole segment past the third
    assert t.stats.faults == 0 and t.stats.bytes_read > 0
    t.close()


def test_a_damaged_segment_ends_the_run_and_counts_a_fault() -> None:
    backend = MemoryBackend()
    t = tier(backend)
    hashes = chain(4)
    for s in (0, 1):
        t.save(t.segment_hashes(hashes, s), segment_kv(2, s))
    t.close()
    key = SCOPE.key(hashes[3])  # the second segment's last block names it
    backend.objects[key] = backend.objects[key][:-1] + b"\0"
    t = tier(backend)
    lookup = t.lookup(hashes, 0)
    assert lookup is not None and len(lookup.future.result(timeout=10)) == 1 and t.stats.faults == 1
    t.close()


def test_a_failing_backend_is_a_miss_and_a_fault_never_an_exception() -> None:
    class Failing(MemoryBackend):
        def get(self, key: str) -> bytes | None:
            raise ConnectionError("tier unreachable")

        def put(self, key: str, data: bytes) -> None:
            raise ConnectionError("tier unreachable")

    t = tier(Failing())
    hashes = chain(2)
    t.save(hashes, segment_kv(2, 0))
    lookup = t.lookup(hashes, 0)
    assert lookup is not None and lookup.future.result(timeout=10) == []
    t.close()
    assert t.stats.faults == 2 and t.stats.segments_written == 0


def test_writes_beyond_the_queue_are_dropped_not_waited_for() -> None:
    release = threading.Event()

    class Slow(MemoryBackend):
        def put(self, key: str, data: bytes) -> None:
            release.wait(10)
            super().put(key, data)

    backend = Slow()
    t = tier(backend, max_pending_writes=2)
    hashes = chain(12)
    started = time.monotonic()
    results = [t.save(t.segment_hashes(hashes, s), segment_kv(2, s)) for s in range(6)]
    assert time.monotonic() - started < 5  # never blocked on the slow backend
    assert results.count(False) >= 3 and t.stats.writes_dropped == results.count(False)
    release.set()
    t.close()
    assert len(backend.objects) == results.count(True)
