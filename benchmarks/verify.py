"""What checking the cached blobs of a snapshot costs at cold start: sizes (a stat each) against hashes (xxh3-128
of every byte).

    python benchmarks/verify.py [--model smollm2-135m] [--rounds 5] [--json]

A snapshot of the model (random weights, bf16, no prefixes) is built once into a scratch cache. Reported,
medians of ``--rounds``:

- xxh3 MB/s over the largest blob, from memory (the hash alone) and from the page cache (read + hash);
- the whole snapshot: size check, hash check with the page cache warm, and cold (every blob dropped from
  the page cache with posix_fadvise(DONTNEED) first: the disk read is then part of it).

Compare with `benchmarks/load.py` (a snapshot load from the cache maps the blobs and reads none of them) and
`benchmarks/cold_start.py`; docs/BENCHMARKS.md has all three.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workloads import SHARED_BENCH  # noqa: E402


def drop_from_page_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def median_seconds(fn: Callable[[], object], rounds: int, before: Callable[[], None] = lambda: None) -> float:
    times = []
    for _ in range(rounds):
        before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from benchmarks.throughput import model_dir as bench_model_dir
    from warmstart.snapshot.build import BuildOptions, build_snapshot
    from warmstart.snapshot.cache import BlobCache
    from warmstart.snapshot.transfer import discard_damaged

    model = bench_model_dir(SHARED_BENCH / "models" / f"{args.model}.json")
    with tempfile.TemporaryDirectory() as tmp:
        cache = BlobCache(Path(tmp) / "cache")
        built = build_snapshot(model, BuildOptions(dtype="bfloat16"), cache)
        sizes = built.manifest.blob_sizes()
        paths = [cache.path(b) for b in sizes]
        total = sum(sizes.values())
        largest = max(sizes, key=sizes.__getitem__)
        data = cache.path(largest).read_bytes()
        mb = len(data) / 1e6

        def check(verify_hash: bool) -> None:
            assert not discard_damaged(cache, sizes, verify_hash=verify_hash)

        results = {
            "model": args.model,
            "blobs": len(sizes),
            "bytes": total,
            "largest_blob_bytes": len(data),
            "xxh3_mb_per_s_memory": mb / median_seconds(lambda: xxhash.xxh3_128_hexdigest(data), args.rounds),
            "xxh3_mb_per_s_page_cache": mb / median_seconds(lambda: cache.find_bad(largest), args.rounds),
            "sizes_s": median_seconds(lambda: check(False), args.rounds),
            "hashes_warm_s": median_seconds(lambda: check(True), args.rounds),
            "hashes_cold_s": median_seconds(lambda: check(True), args.rounds, lambda: drop_from_page_cache(paths)),
        }
    if args.json:
        print(json.dumps(results))
        return
    print(f"{args.model}: {results['blobs']} blobs, {total / 1e6:.1f} MB (largest {len(data) / 1e6:.1f} MB); "
          f"medians of {args.rounds}")
    print(f"  xxh3-128, largest blob: {results['xxh3_mb_per_s_memory']:,.0f} MB/s in memory, "
          f"{results['xxh3_mb_per_s_page_cache']:,.0f} MB/s read from the page cache")
    print(f"  whole snapshot: sizes {results['sizes_s'] * 1e3:.2f} ms, hashes {results['hashes_warm_s'] * 1e3:.1f} ms "
          f"(page cache warm), {results['hashes_cold_s'] * 1e3:.1f} ms (cold)")


if __name__ == "__main__":
    main()
