"""Pull throughput from a moto S3 server on loopback: our pull_blobs against boto3's download_file.

    python -m benchmarks.pull [--total-mb 300] [--blobs 4] [--rounds 3] [--json OUT]

The script starts moto's server in its own process on 127.0.0.1 (so that it does not share our GIL, as a
real endpoint would not), uploads --blobs random blobs totalling --total-mb, then pulls all of them into an
empty directory per run, variants alternating in order round after round:

- ours: `snapshot.transfer.pull_blobs` (parallel ranged GETs over parts of all blobs, each blob verified
  against its xxh3-128 name, fsynced and renamed into a cache), at its defaults and other settings;
- boto3: `download_file` with its default TransferConfig (8 MB parts, 10 threads), blob after blob.

MB/s = total bytes / wall time (MB = 10^6 bytes); medians over rounds, and the ratio to boto3's median.
Moto's server copies an object's whole value to serve each ranged GET, so on this server large parts pay
off more than they would against S3 itself.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks import harness
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.format import blob_id
from warmstart.snapshot.s3 import S3Store
from warmstart.snapshot.transfer import pull_blobs

BUCKET = "bench"
MiB = 1 << 20


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto server process on a free loopback port; yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the moto server did not start") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def upload_blobs(store: S3Store, total_mb: int, count: int, work: Path) -> dict[str, int]:
    sizes = {}
    each = total_mb * 10**6 // count
    for i in range(count):
        data = os.urandom(each + i)  # distinct sizes: no two blobs alike
        path = work / "upload"
        path.write_bytes(data)
        bid = blob_id(data)
        store.put_blob(bid, path)
        sizes[bid] = len(data)
    (work / "upload").unlink()
    return sizes


def ours(store: S3Store, sizes: dict[str, int], **settings: int) -> Callable[[Path], None]:
    def run(target: Path) -> None:
        pull_blobs(store, BlobCache(target), sizes, **settings)

    return run


def boto3_default(store: S3Store, sizes: dict[str, int]) -> Callable[[Path], None]:
    def run(target: Path) -> None:
        target.mkdir()
        for bid in sizes:
            store.client.download_file(BUCKET, f"blobs/{bid}", str(target / bid))

    return run


def main() -> None:
    parser = harness.arguments(__doc__, rounds=3)
    parser.add_argument("--total-mb", type=int, default=300)
    parser.add_argument("--blobs", type=int, default=4)
    args = harness.parse(parser)

    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true")
    with moto_server() as url, tempfile.TemporaryDirectory(prefix="pull-bench-") as tmp:
        os.environ["AWS_ENDPOINT_URL"] = url
        work = Path(tmp)
        store = S3Store(f"s3://{BUCKET}")
        store.client.create_bucket(Bucket=BUCKET)
        sizes = upload_blobs(store, args.total_mb, args.blobs, work)
        total = sum(sizes.values())
        variants: dict[str, Callable[[Path], None]] = {
            "ours (defaults: 8 x 16 MiB)": ours(store, sizes),
            "ours (4 x 32 MiB)": ours(store, sizes, concurrency=4, part_size=32 * MiB),
            "ours (16 x 8 MiB)": ours(store, sizes, concurrency=16, part_size=8 * MiB),
            "ours (8 x 64 MiB)": ours(store, sizes, concurrency=8, part_size=64 * MiB),
            "boto3 download_file (defaults)": boto3_default(store, sizes),
        }
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                target = work / "target"
                started = time.perf_counter()
                variants[name](target)
                seconds[name].append(time.perf_counter() - started)
                shutil.rmtree(target)
    rates = {name: [total / 1e6 / s for s in runs] for name, runs in seconds.items()}
    baseline = rates["boto3 download_file (defaults)"]
    rows = [{"variant": name, "mb_per_s": round(harness.median(r), 1), "min": round(min(r), 1),
             "max": round(max(r), 1), "ratio_to_boto3": round(harness.ratio(r, baseline)["median"], 2)}
            for name, r in rates.items()]
    print(f"pull of {len(sizes)} blobs, {total / 1e6:.0f} MB, from moto on 127.0.0.1; median of {args.rounds} rounds")
    print(f"{'variant':<34} {'MB/s':>7} {'min':>7} {'max':>7} {'vs boto3':>9}")
    for row in rows:
        print(f"{row['variant']:<34} {row['mb_per_s']:>7} {row['min']:>7} {row['max']:>7} "
              f"{row['ratio_to_boto3']:>8}x")
    harness.report(args, {"total_bytes": total, "blobs": len(sizes), "rounds": args.rounds, "results": rows})


if __name__ == "__main__":
    main()
