"""KV that outlives the instance: full blocks' KV kept in a tier below the pool (a local disk, the object store),
keyed like the prefix cache, so that a fresh instance loads a conversation's or a document's KV instead of
computing it again.

What is stored is a *segment*: ``segment_blocks`` consecutive full blocks of one chain, aligned to a multiple of
``segment_blocks`` from the chain's start, packed into one object (a 4k-token history is a few GETs, not
hundreds). An object is named by its scope (tenant namespace, the weights' fingerprint, the adapter and the KV
layout: KV never crosses models, adapters or tenants) and the chained hash of its last block, which covers every
token before it. Only whole segments are stored; a tail shorter than a segment is computed again. A lookup tries
a chain's segments from the start and keeps the longest run that loads.

Every object carries its chain hashes and its layout, and ends with an HMAC-SHA256 of all of it under a key the
instances that share the tier share (handlers/server/kv_tier_options.py says where it comes from): whoever can write to
the tier but lacks the key cannot make a segment a server will load, and a segment of another tenant namespace
or another key is refused. Anything that does not match what was asked (a forged or damaged object, a hash
collision, a layout from another build) is a miss, counted as a fault, never KV in the pool. Backends are plain
key -> bytes stores (snapshot/kv_tier_backends.py); all their I/O runs on this module's threads, off the
engine's step loop: writes are queued (and dropped, counted, when the queue is full), reads are futures a waiting
sequence polls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import queue
import struct
import threading
import time
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

MAGIC = b"WSKV"
FORMAT_VERSION = 2  # 1 had an unkeyed checksum, which a forger recomputes
MAC_LEN = 32
MIN_KEY_BYTES = 16
DEFAULT_SEGMENT_BLOCKS = 16
_HEADER_LEN = struct.Struct("<I")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVTierBackend(Protocol):
    """Where segments live. Keys are '/'-separated names of [0-9A-Za-z._-] parts."""

    def get(self, key: str) -> bytes | None:
        """The object, or None when there is none; raises when the backend fails."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Store the object whole (readers never see a part)."""
        ...


class TierCorrupt(ValueError):
    """An object that is not the segment asked for."""


@dataclass(frozen=True)
class TierScope:
    """What a block's KV depends on besides its tokens."""

    namespace: str  # the tenant (--kv-tier-namespace)
    model: str  # the weights' fingerprint (the snapshot's id)
    adapter: str  # "" for the base model
    dtype: str  # the pool's
    block_size: int
    shape: tuple[int, int, int]  # (layers, kv_heads, head_dim)

    @property
    def prefix(self) -> str:
        layers, kv_heads, head_dim = self.shape
        layout = f"{self.dtype}-b{self.block_size}-{layers}x{kv_heads}x{head_dim}"
        return f"{self.namespace}/{self.model}/{self.adapter or '-'}/{layout}"

    def key(self, last_block_hash: int) -> str:
        return f"{self.prefix}/{last_block_hash:016x}"

    def segment_shape(self, blocks: int) -> tuple[int, ...]:
        """[layers, 2 (K, V), kv_heads, blocks, block_size, head_dim]: the pool's layout, as the runner reads it."""
        layers, kv_heads, head_dim = self.shape
        return (layers, 2, kv_heads, blocks, self.block_size, head_dim)


def _mac(key: bytes, signed: bytes | memoryview) -> bytes:
    return hmac.new(key, signed, hashlib.sha256).digest()


def pack(scope: TierScope, hashes: Seq[int], kv: torch.Tensor, key: bytes, written_at: float | None = None) -> bytes:
    """One segment as bytes: magic, header length, a JSON header, the KV's raw bytes, then the HMAC of them all."""
    if tuple(kv.shape) != scope.segment_shape(len(hashes)) or str(kv.dtype).removeprefix("torch.") != scope.dtype:
        raise ValueError(f"KV {tuple(kv.shape)} {kv.dtype} is not a segment of {len(hashes)} blocks of {scope.prefix}")
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    header = json.dumps({
        "version": FORMAT_VERSION, "scope": scope.prefix, "hashes": [f"{h:016x}" for h in hashes],
        "written_at": time.time() if written_at is None else written_at,
    }).encode()  # fmt: skip
    signed = MAGIC + _HEADER_LEN.pack(len(header)) + header + payload
    return signed + _mac(key, signed)


def unpack(data: bytes, scope: TierScope, hashes: Seq[int], key: bytes, max_age_s: float | None = None
           ) -> torch.Tensor:  # fmt: skip
    """The KV of the segment whose chain hashes are ``hashes``; TierCorrupt when ``data`` is anything else,
    first of all when it is not signed with ``key``."""
    if data[:4] != MAGIC:
        raise TierCorrupt("not a warmstart KV segment")
    signed = memoryview(data)[:-MAC_LEN]
    if len(data) < 8 + MAC_LEN or not hmac.compare_digest(_mac(key, signed), data[-MAC_LEN:]):
        raise TierCorrupt("not signed with this tier's key (forged, damaged, or written under another key)")
    try:
        (header_len,) = _HEADER_LEN.unpack_from(data, 4)
        header = json.loads(bytes(signed[8 : 8 + header_len]))
        payload = signed[8 + header_len :]
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise TierCorrupt(f"unreadable header: {e}") from None
    if header.get("version") != FORMAT_VERSION or header.get("scope") != scope.prefix:
        raise TierCorrupt(f"written for {header.get('scope')!r} (format {header.get('version')}), not {scope.prefix}")
    if header.get("hashes") != [f"{h:016x}" for h in hashes]:
        raise TierCorrupt("its chain is not the one asked for")
    if max_age_s is not None and time.time() - float(header.get("written_at", 0)) > max_age_s:
        raise TierCorrupt("older than the tier's time to live")
    shape = scope.segment_shape(len(hashes))
    dtype = _DTYPES[scope.dtype]
    if len(payload) != dtype.itemsize * torch.Size(shape).numel():
        raise TierCorrupt(f"{len(payload)} payload bytes, not {shape} of {scope.dtype}")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(shape)


@dataclass
class TierStats:
    """Counters for /metrics and /status; blocks and tokens are counted when a lookup's result is used."""

    hit_blocks: int = 0
    miss_blocks: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    load_seconds: float = 0.0
    segments_written: int = 0
    writes_dropped: int = 0  # the write queue was full
    faults: int = 0  # a backend error, a timeout or a damaged object: computed again instead
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def counters(self, block_size: int) -> dict[str, float]:
        with self.lock:
            values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "lock"}
        values["hit_tokens"] = values["hit_blocks"] * block_size
        values["miss_tokens"] = values["miss_blocks"] * block_size
        return values

    def add(self, **amounts: float) -> None:
        with self.lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)


@dataclass
class Lookup:
    """A lookup in flight: the KV of the chain's first segments, in order, as far as they loaded."""

    first_segment: int  # index of the first segment looked up (the ones before were cached in the pool)
    future: Future[list[torch.Tensor]]
    started: float


class KVTier:
    def __init__(
        self, backend: KVTierBackend, scope: TierScope, segment_blocks: int = DEFAULT_SEGMENT_BLOCKS,
        max_age_s: float | None = None, max_pending_writes: int = 64, read_threads: int = 4, fetch_threads: int = 16,
        *, key: bytes,
    ) -> None:  # fmt: skip
        if segment_blocks < 1:
            raise ValueError(f"segment_blocks must be at least 1, not {segment_blocks}")
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the KV tier's signing key must be at least {MIN_KEY_BYTES} bytes, not {len(key)}")
        self.backend, self.scope, self.segment_blocks, self.max_age_s = backend, scope, segment_blocks, max_age_s
        self._key = key
        self.stats = TierStats()
        self._writes: queue.Queue[tuple[TierScope, list[int], torch.Tensor] | None] = queue.Queue(max_pending_writes)
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix="kv-tier-reader")  # one per lookup
        self._fetchers = ThreadPoolExecutor(fetch_threads, thread_name_prefix="kv-tier-fetch")  # one per GET

    def whole_segments(self, num_blocks: int) -> int:
        return num_blocks // self.segment_blocks

    def scope_for(self, adapter: str | None) -> TierScope:
        return self.scope if not adapter else dataclasses.replace(self.scope, adapter=adapter)

    def save(self, hashes: Seq[int], kv: torch.Tensor, adapter: str | None = None) -> bool:
        """Queue one segment's KV (a copy the caller no longer touches) for writing; False when it was dropped."""
        assert len(hashes) == self.segment_blocks
        try:
            self._writes.put_nowait((self.scope_for(adapter), list(hashes), kv))
            return True
        except queue.Full:
            self.stats.add(writes_dropped=1)
            return False

    def lookup(self, hashes: Seq[int], first_segment: int, adapter: str | None = None) -> Lookup | None:
        """Start loading the whole segments of the chain ``hashes`` from ``first_segment`` on; None when it has
        no whole segment past those."""
        last = self.whole_segments(len(hashes))
        if first_segment >= last:
            return None
        chain = list(hashes[: last * self.segment_blocks])
        future = self._readers.submit(self._read_run, self.scope_for(adapter), chain, first_segment)
        return Lookup(first_segment, future, time.monotonic())

    def segment_hashes(self, hashes: Seq[int], segment: int) -> list[int]:
        start = segment * self.segment_blocks
        return list(hashes[start : start + self.segment_blocks])

    def close(self, timeout: float = 5.0) -> None:
        """Finish the queued writes (within ``timeout``) and stop the threads."""
        with contextlib.suppress(queue.Full):
            self._writes.put(None, timeout=timeout)
        self._writer.join(timeout)
        self._readers.shutdown(wait=False, cancel_futures=True)
        self._fetchers.shutdown(wait=False, cancel_futures=True)

    # -- on the tier's threads ---------------------------------------------------------------------------

    def _read_run(self, scope: TierScope, chain: list[int], first_segment: int) -> list[torch.Tensor]:
        """Segments first_segment.. of ``chain`` until the first that is absent or unusable; their GETs run at once
        (a 4k-token history is 16 of them), the run is cut where the first one fails."""
        start = time.monotonic()
        segments = [self.segment_hashes(chain, s) for s in range(first_segment, len(chain) // self.segment_blocks)]
        gets = [self._fetchers.submit(self.backend.get, scope.key(hashes[-1])) for hashes in segments]
        loaded: list[torch.Tensor] = []
        for hashes, get in zip(segments, gets, strict=True):
            try:
                data = get.result()
                if data is None:
                    break
                loaded.append(unpack(data, scope, hashes, self._key, self.max_age_s))
                self.stats.add(bytes_read=len(data))
            except Exception:  # a failing or damaged tier costs a recompute, never a request
                self.stats.add(faults=1)
                break
        for get in gets[len(loaded) + 1 :]:
            get.cancel()
        self.stats.add(load_seconds=time.monotonic() - start)
        return loaded

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            scope, hashes, kv = item
            try:
                data = pack(scope, hashes, kv, self._key)
                self.backend.put(scope.key(hashes[-1]), data)
                self.stats.add(bytes_written=len(data), segments_written=1)
            except Exception:
                self.stats.add(faults=1)
