"""Blob files and a manifest listing them, as a build leaves them, for the store and transfer tests."""

from __future__ import annotations

import random
from pathlib import Path

from warmstart.snapshot.format import FORMAT, FORMAT_VERSION, Manifest, blob_id
from warmstart.snapshot.store import Store
from warmstart.snapshot.transfer import push_snapshot

SIZES = (300_000, 700_001, (1 << 20) + 1, 0, 5)


class Built:
    """Blob files and a manifest listing them, as a build leaves them."""

    def __init__(self, root: Path, sizes: tuple[int, ...] = SIZES, seed: int = 0, extra: bytes = b"") -> None:
        root.mkdir(parents=True, exist_ok=True)
        rng = random.Random(seed)
        self.paths: dict[str, Path] = {}
        for size in sizes:
            data = rng.randbytes(size) + extra if size else extra
            path = root / f"tmp-{len(self.paths)}"
            path.write_bytes(data)
            bid = blob_id(data)
            self.paths[bid] = path.rename(root / bid)
        self.sizes = {bid: path.stat().st_size for bid, path in self.paths.items()}
        self.manifest = Manifest({"format": FORMAT, "format_version": FORMAT_VERSION, "blobs": self.sizes,
                                  "seed": seed}).encode()
        self.id = blob_id(self.manifest)

    def push(self, store: Store) -> None:
        push_snapshot(store, self.manifest, self.id, self.paths)
