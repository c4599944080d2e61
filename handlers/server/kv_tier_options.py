"""`warmstart serve --kv-tier off|disk|s3`: the KV tier's flags, checked before anything loads, and attaching
the tier to a loaded engine (runtime/engine/kv_tier.py, snapshot/kv_tier_backends.py).

The tier holds what users sent and received (their conversations' KV): it is off unless asked for, the object
store needs its own explicit --kv-store (it writes to the user's bucket), and segments are named under the
snapshot's id and --kv-tier-namespace, so tenants that must not share blocks each get a namespace.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmstart.handlers.errors import CliError

KINDS = ("off", "disk", "s3")
DEFAULT_MAX_BYTES = 10 << 30
DEFAULT_TTL_S = 7 * 86400.0
KEY_ENV = "WARMSTART_KV_TIER_KEY"
MIN_KEY_BYTES = 16  # runtime/engine/kv_tier.py's (not imported here: this module loads before the server listens)
_NAMESPACE = re.compile(r"^[0-9A-Za-z_.-]{1,64}$")


@dataclass(frozen=True)
class KVTierConfig:
    kind: str
    directory: Path
    store: str | None
    max_bytes: int
    ttl_s: float
    namespace: str
    segment_blocks: int | None  # None: the tier's default
    key: bytes | None  # signs the segments; None: the disk tier's own (DiskBackend.shared_key)


def add_arguments(serve: Any) -> None:
    tier = serve.add_argument_group("kv tier (KV kept beyond the instance; holds users' conversations: see "
                                    "docs/serving.md)")
    tier.add_argument("--kv-tier", choices=KINDS, default="off",
                      help="keep computed KV on a local disk or in an object store, and load it for later prompts "
                           "that start the same way (default off)")  # fmt: skip
    tier.add_argument("--kv-tier-dir", type=Path, metavar="DIR",
                      help="the disk tier's directory (default ~/.cache/warmstart/kv-tier)")
    tier.add_argument("--kv-store", metavar="URI",
                      help="the object store tier's place: s3://BUCKET/PREFIX or a directory")
    tier.add_argument("--kv-tier-max-bytes", type=int, default=DEFAULT_MAX_BYTES, metavar="BYTES",
                      help="the disk tier's budget; least recently used segments go first (default 10 GiB)")
    tier.add_argument("--kv-tier-ttl", type=float, default=DEFAULT_TTL_S, metavar="SECONDS",
                      help="segments older than this are not used (default 7 days; on S3 add a lifecycle rule)")
    tier.add_argument("--kv-tier-segment-blocks", type=int, metavar="N",
                      help="KV blocks per stored object; only whole segments are stored (default 16: 256 tokens "
                           "at the default block size)")  # fmt: skip
    tier.add_argument("--kv-tier-namespace", default="default", metavar="NAME",
                      help="tenants with different namespaces never share KV (default: default)")
    tier.add_argument("--kv-tier-key-file", type=Path, metavar="PATH",
                      help=f"a file holding the secret that signs the tier's segments (HMAC), the same for every "
                           f"instance sharing the tier; or set ${KEY_ENV}. Required for --kv-tier s3; the disk tier "
                           "otherwise keeps one in its directory")


def config_from(args: argparse.Namespace) -> KVTierConfig | None:
    """The tier asked for, or None; CliError naming the flag for anything that cannot work."""
    if args.kv_tier == "off":
        for flag, value in (("--kv-store", args.kv_store), ("--kv-tier-dir", args.kv_tier_dir)):
            if value is not None:
                kind = "s3" if flag == "--kv-store" else "disk"
                raise CliError(f"{flag} is set but --kv-tier is off; add --kv-tier {kind}")
        return None
    if not _NAMESPACE.match(args.kv_tier_namespace):
        raise CliError("--kv-tier-namespace must be 1-64 letters, digits, '.', '_' or '-', "
                       f"got {args.kv_tier_namespace!r}")
    if not args.kv_tier_max_bytes > 0:
        raise CliError(f"--kv-tier-max-bytes must be positive, got {args.kv_tier_max_bytes}")
    if args.kv_tier_segment_blocks is not None and not args.kv_tier_segment_blocks > 0:
        raise CliError(f"--kv-tier-segment-blocks must be positive, got {args.kv_tier_segment_blocks}")
    if not args.kv_tier_ttl > 0:
        raise CliError(f"--kv-tier-ttl must be a number of seconds > 0, got {args.kv_tier_ttl}")
    if args.kv_tier == "s3" and not args.kv_store:
        raise CliError("--kv-tier s3 writes users' KV to a bucket: name it with --kv-store s3://BUCKET/PREFIX")
    if args.kv_tier == "disk" and args.kv_store:
        raise CliError("--kv-store is for --kv-tier s3; the disk tier takes --kv-tier-dir")
    if args.tensor_parallel > 1:
        raise CliError("--kv-tier does not combine with --tensor-parallel yet; leave one of them out")
    if args.speculative == "draft":
        raise CliError("--kv-tier does not combine with --speculative draft (the tier holds the target's KV only)")
    directory = args.kv_tier_dir or Path.home() / ".cache" / "warmstart" / "kv-tier"
    return KVTierConfig(args.kv_tier, directory, args.kv_store, args.kv_tier_max_bytes, args.kv_tier_ttl,
                        args.kv_tier_namespace, args.kv_tier_segment_blocks, signing_key(args))


def signing_key(args: argparse.Namespace) -> bytes | None:
    """The secret the tier's segments are signed with: --kv-tier-key-file's, else $WARMSTART_KV_TIER_KEY's; None
    lets the disk tier use its own. Whoever can write to a shared bucket must not be able to make KV a server
    loads, so the s3 tier needs one."""
    if args.kv_tier_key_file is not None:
        try:
            key = args.kv_tier_key_file.read_bytes().strip()
        except OSError as e:
            raise CliError(f"--kv-tier-key-file {args.kv_tier_key_file}: {e.strerror or e}") from None
        where = f"--kv-tier-key-file {args.kv_tier_key_file}"
    elif os.environ.get(KEY_ENV):
        key, where = os.environ[KEY_ENV].strip().encode(), f"${KEY_ENV}"
    elif args.kv_tier == "s3":
        raise CliError(f"--kv-tier s3 signs its segments with a secret every instance shares, so that whoever can "
                       f"write to the bucket cannot plant KV: set ${KEY_ENV} or give --kv-tier-key-file (e.g. 32 "
                       "random bytes: `head -c 32 /dev/urandom | base64`)")
    else:
        return None
    if len(key) < MIN_KEY_BYTES:
        raise CliError(f"{where} holds {len(key)} bytes; the KV tier's key needs at least {MIN_KEY_BYTES} (e.g. "
                       "`head -c 32 /dev/urandom | base64`)")
    return key


def attach(engine: Any, snapshot_id: str, config: KVTierConfig) -> dict[str, Any]:
    """Give ``engine`` its tier; returns what /status says about it."""
    from warmstart.runtime.engine.kv_tier import DEFAULT_SEGMENT_BLOCKS, KVTier, TierScope
    from warmstart.snapshot.kv_tier_backends import DiskBackend, StoreBackend
    from warmstart.snapshot.s3 import REQUEST_SIZED
    from warmstart.snapshot.stores import open_store

    backend: DiskBackend | StoreBackend
    if config.kind == "disk":
        backend = DiskBackend(config.directory, config.max_bytes)
        where = str(config.directory)
    else:
        backend = StoreBackend(open_store(config.store, REQUEST_SIZED))
        where = backend.store.uri
    c = engine.config
    scope = TierScope(config.namespace, snapshot_id, "", engine.options.dtype, engine.blocks.block_size,
                      (c.num_layers, c.num_kv_heads, c.head_dim))
    segment_blocks = config.segment_blocks or DEFAULT_SEGMENT_BLOCKS
    key = config.key if config.key is not None else backend.shared_key() if isinstance(backend, DiskBackend) else None
    if key is None:  # config_from refuses an s3 tier without a key
        raise ValueError("the KV tier has no signing key")
    engine.attach_kv_tier(KVTier(backend, scope, segment_blocks, max_age_s=config.ttl_s, key=key))
    return {"kind": config.kind, "where": where, "namespace": config.namespace, "ttl_s": config.ttl_s,
            "segment_tokens": segment_blocks * engine.blocks.block_size,
            **({"max_bytes": config.max_bytes} if config.kind == "disk" else {})}
