"""`warmstart build | pull | verify | ls | inspect | tag | lora push | gc`: snapshots from the command line.

Every failure a user can cause ends in one sentence on stderr and exit status 1 (see handlers.cli.main.main);
`ls` exits with LS_INCOMPLETE (3) when it listed the store but flagged entries it cannot read.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warmstart.handlers.errors import CliError, positive_int
from warmstart.handlers.server.manifest_summary import adapter_summaries, lora_summaries, selector_summary
from warmstart.runtime.engine.options import EngineOptions

if TYPE_CHECKING:
    from warmstart.snapshot.format import Manifest
    from warmstart.snapshot.store import Store
    from warmstart.snapshot.verify import VerifyReport

LS_INCOMPLETE = 3  # `ls` exit status: listed what it could read, flagged the entries it could not


def add_commands(sub: Any) -> None:
    build = sub.add_parser("build", help="build a snapshot from an HF model directory or hub id and push it to a store")
    build.add_argument("model", metavar="MODEL", help="an HF model directory; a hub id (ORG/NAME) fetched through "
                       "huggingface_hub's cache (HF_HOME, HF_TOKEN, HF_HUB_OFFLINE); or a GGUF file, dequantized "
                       "once into an HF directory (needs transformers and gguf)")
    build.add_argument("--revision", help="the hub id's branch, tag or commit (default main); the commit the files "
                       "come from is recorded in the snapshot's provenance")
    build.add_argument("--prefix", action="append", default=[], metavar="NAME=FILE",
                       help="precompute the KV of this text (tokenized as is)")
    build.add_argument("--system", action="append", default=[], metavar="NAME=FILE",
                       help="precompute the KV of this chat system prompt (rendered by the chat template)")
    build.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                       help="compile a PEFT prompt-tuning, P-tuning or prefix-tuning adapter into prefix KV")
    build.add_argument("--adapter-examples", action="append", default=[], metavar="NAME=FILE",
                       help="example queries for adapter NAME, one per line: builds the 'auto' selector")
    build.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                       help="a PEFT LoRA adapter served unmerged, stored as its own blob (repeatable): requests "
                            "pick it by name as compiled adapters are picked")
    build.add_argument("--lora-merge", type=Path, metavar="DIR", help="merge this PEFT LoRA adapter into the weights")
    build.add_argument("--quant", default="none", help="none | int8 | int4 | nf4 (weight-only)")
    build.add_argument("--group-size", type=positive_int, default=None,
                       help="int4/nf4 group size: 32, 64, 128 or 256 (default: the largest that fits, up to 128)")
    build.add_argument("--dtype", default="auto",
                       help="auto | bfloat16 | float16 | float32 (default auto: bfloat16, which serves on every "
                       "CPU kind)")
    build.add_argument("--block-size", type=positive_int, default=EngineOptions.block_size,
                       help=f"KV block size the engine will use (default {EngineOptions.block_size})")
    build.add_argument("--draft", type=Path, metavar="DRAFT_DIR",
                       help="a draft model (same tokenizer) for `serve --speculative draft`, stored as its own blobs")
    build.add_argument("--draft-quant", default="none", help="the draft's quantization: none | int8 | int4 | nf4")
    build.add_argument("--draft-group-size", type=positive_int, default=None, help="the draft's quantization group")
    build.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="N",
                       help="shard weights and prefix KV for N ranks; each rank pulls only its part (default 1)")
    build.add_argument("--tag", action="append", default=[], metavar="NAME", help="point this ref at the snapshot")
    _common(build, cache=True)
    build.set_defaults(func=cmd_build)

    pull = sub.add_parser("pull", help="download a snapshot into the local cache")
    pull.add_argument("ref")
    pull.add_argument("--concurrency", type=positive_int, default=8)
    pull.add_argument("--part-size-mb", type=positive_int, default=16)
    _common(pull, cache=True)
    pull.set_defaults(func=cmd_pull)

    ls = sub.add_parser("ls", help="list the store's snapshots and refs",
                        epilog=f"A manifest or ref that cannot be used is flagged and the rest listed; the exit "
                               f"status is then {LS_INCOMPLETE} (0 when all is well, 1 when the store cannot be "
                               "listed).")
    _common(ls)
    ls.set_defaults(func=cmd_ls)

    inspect = sub.add_parser("inspect", help="show what a snapshot holds")
    inspect.add_argument("ref")
    _common(inspect, cache=True)
    inspect.set_defaults(func=cmd_inspect)

    tag = sub.add_parser("tag", help="point a ref (a mutable name) at a snapshot")
    tag.add_argument("ref")
    tag.add_argument("name")
    _common(tag)
    tag.set_defaults(func=cmd_tag)

    verify = sub.add_parser("verify", help="hash the cached blobs of a snapshot (or of the whole cache); "
                                           "remove the damaged ones and download them again")
    verify.add_argument("ref", nargs="?", help="a snapshot id, id prefix or ref (default: every blob in the cache)")
    verify.add_argument("--concurrency", type=positive_int, default=8)
    _common(verify, cache=True)
    verify.set_defaults(func=cmd_verify)

    lora = sub.add_parser("lora", help="LoRA adapters stored on their own against a snapshot")
    lora_actions = lora.add_subparsers(dest="lora_action", metavar="ACTION")
    push = lora_actions.add_parser("push", help="convert a PEFT LoRA adapter for a snapshot's model and upload it "
                                                "(only its own blobs); a server of that snapshot then loads it by name "
                                                "with POST /v1/load_lora_adapter")
    push.add_argument("adapter", metavar="NAME=DIR", help="the adapter's name and its PEFT directory")
    push.add_argument("--snapshot", required=True, metavar="REF", help="the base snapshot: an id, id prefix or ref")
    _common(push, cache=True)
    push.set_defaults(func=cmd_lora_push)

    gc = sub.add_parser("gc", help="delete blobs that no snapshot in the store references, and temporary files "
                                   "that killed processes left in the store and the local cache")
    gc.add_argument("--dry-run", action="store_true", help="list what would be deleted; delete nothing")
    gc.add_argument("--grace-seconds", type=int, default=3600,
                    help="keep unreferenced blobs and temporary files younger than this (a push, pull or build may "
                         "be writing them)")
    _common(gc, cache=True)
    gc.set_defaults(func=cmd_gc)


def _common(parser: argparse.ArgumentParser, cache: bool = False) -> None:
    parser.add_argument("--store", help="a directory, file://PATH or s3://BUCKET/PREFIX (default $WARMSTART_STORE)")
    if cache:
        parser.add_argument("--cache", type=Path, help="local blob cache (default $WARMSTART_CACHE)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn the errors a user can cause into one clear sentence."""
    from warmstart.runtime.models.config import ModelConfigError
    from warmstart.snapshot.errors import StoreError
    from warmstart.snapshot.format import FormatError

    try:
        yield
    except (StoreError, FormatError, ModelConfigError) as e:
        raise CliError(str(e)) from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            where = e.filename or "writing the cache"
            raise CliError(f"the disk is full ({where}); free space or use --cache DIR") from None
        raise CliError(f"{e.strerror or e} ({e.filename})" if e.filename else str(e)) from None


def _log(args: argparse.Namespace) -> Callable[[str], None]:
    if args.quiet or args.json:
        return lambda _: None
    return lambda message: print(message, file=sys.stderr)


def _cache(args: argparse.Namespace) -> Any:
    from warmstart.snapshot.cache import BlobCache

    return BlobCache(args.cache)


def model_to_build(model: str, revision: str | None,
                   log: Callable[[str], None] = lambda _: None) -> tuple[Path, dict[str, str] | None]:  # fmt: skip
    """MODEL as a directory to build, and where it came from: a hub id is resolved (downloaded where needed) into
    huggingface_hub's cache, a GGUF file converted once into the models cache; a local directory has no origin."""
    from warmstart.snapshot import hub

    path = Path(model).expanduser()
    if revision is not None and not hub.is_hub_id(model):
        raise CliError(f"--revision is for a hub id; {model} is a local {'directory' if path.is_dir() else 'file'}")
    if path.is_dir():
        return path, None
    if path.is_file() and path.suffix == ".gguf":
        from warmstart.snapshot.prepare_model import PrepareError, gguf_model_dir

        try:
            return gguf_model_dir(path, log)
        except PrepareError as e:
            raise CliError(str(e)) from None
    if not hub.is_hub_id(model):
        raise CliError(f"{model} is not a directory; give an HF model directory (config.json, *.safetensors, "
                       "tokenizer.json), a GGUF file or a hub id (ORG/NAME), or `warmstart prepare-model smollm2` "
                       "for the demo's model")
    try:
        resolved = hub.resolve(model, revision)
    except hub.HubError as e:
        raise CliError(str(e)) from None
    return resolved.path, resolved.provenance()


def cmd_build(args: argparse.Namespace) -> int:
    # What the arguments say is checked before the imports below, which take torch's seconds.
    from warmstart.snapshot.errors import StoreError
    from warmstart.snapshot.store import check_new_ref_name

    try:
        for name in args.tag:
            check_new_ref_name(name)  # before the build, not after it
    except StoreError as e:
        raise CliError(str(e)) from None
    model_dir, origin = model_to_build(args.model, args.revision, _log(args))
    with user_errors():
        from warmstart.snapshot.adapters import AdapterSpec
        from warmstart.snapshot.build import BuildError, BuildOptions, PrefixSpec, build_snapshot
        from warmstart.snapshot.stores import open_store
        from warmstart.snapshot.transfer import push_snapshot

        try:
            merge, loras = lora_options(args.lora, args.lora_merge)
            prefixes = [PrefixSpec.parse(p, "text") for p in args.prefix]
            prefixes += [PrefixSpec.parse(p, "system") for p in args.system]
            options = BuildOptions(
                quant=args.quant, group_size=args.group_size, dtype=args.dtype, block_size=args.block_size,
                prefixes=prefixes, adapters=[AdapterSpec.parse(a) for a in args.adapter],
                adapter_examples=[AdapterSpec.parse(e, "--adapter-examples") for e in args.adapter_examples],
                lora=merge, loras=loras, draft=args.draft, draft_quant=args.draft_quant,
                draft_group_size=args.draft_group_size,
                tensor_parallel=args.tensor_parallel,
            )
            store = open_store(args.store)
            built = build_snapshot(model_dir, options, _cache(args), log=_log(args), origin=origin)
        except BuildError as e:
            raise CliError(str(e)) from None
        stats = push_snapshot(store, built.manifest.encode(), built.id, built.blob_paths,
                              progress=not (args.quiet or args.json))
        for name in args.tag:
            store.set_ref(name, built.id)
    view = built.manifest.view()
    result = {"id": built.id, "store": store.uri, "source": origin, "blobs_total": stats.blobs_total,
              "blobs_uploaded": stats.blobs_uploaded, "bytes_uploaded": stats.bytes_uploaded,
              "blobs_replaced": stats.blobs_replaced,
              "tags": args.tag, "prefixes": [{"name": p.name, "tokens": len(p.token_ids)} for p in view.prefixes],
              "adapters": adapter_summaries(view), "loras": lora_summaries(view), "selector": selector_summary(view)}
    if args.json:
        print(json.dumps(result))
    else:
        print(built.id)
        replaced = f"; {stats.blobs_replaced} replaced a damaged copy in the store" if stats.blobs_replaced else ""
        _log(args)(f"{stats.blobs_uploaded} of {stats.blobs_total} blobs uploaded ({stats.bytes_uploaded:,} bytes"
                   f"{replaced})")
    return 0


def lora_options(given: list[str], merge: Path | None) -> tuple[Path | None, list[Any]]:
    """--lora values: NAME=DIR adapters served unmerged, and (deprecated) a bare DIR, merged as --lora-merge DIR."""
    from warmstart.snapshot.adapters import AdapterSpec
    from warmstart.snapshot.errors import BuildError

    specs = []
    for text in given:
        if "=" in text and not Path(text).is_dir():
            specs.append(AdapterSpec.parse(text, "--lora"))
            continue
        if merge is not None:
            raise BuildError(f"--lora {text}: one adapter can be merged into the weights, and --lora-merge {merge} "
                             "already is; serve the others unmerged with --lora NAME=DIR")
        print(f"warmstart: warning: --lora DIR is deprecated: it merges {text} into the weights as --lora-merge DIR "
            "does; use --lora-merge DIR for that, or --lora NAME=DIR to serve the adapter unmerged", file=sys.stderr)
        merge = Path(text)
    return merge, specs


def cmd_pull(args: argparse.Namespace) -> int:
    with user_errors():
        from warmstart.snapshot.refs import resolve_ref
        from warmstart.snapshot.stores import open_store
        from warmstart.snapshot.transfer import pull_snapshot

        store = open_store(args.store)
        snapshot_id = resolve_ref(store, args.ref)
        _, stats = pull_snapshot(store, _cache(args), snapshot_id, concurrency=args.concurrency,
                                 part_size=args.part_size_mb << 20, progress=not (args.quiet or args.json))
    result = {"id": snapshot_id, "blobs_total": stats.blobs_total, "blobs_downloaded": stats.blobs_downloaded,
              "bytes_downloaded": stats.bytes_downloaded, "blobs_replaced": stats.blobs_replaced,
              "seconds": round(stats.seconds, 3)}
    print(json.dumps(result) if args.json else snapshot_id)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    with user_errors():
        from warmstart.snapshot.format import is_id
        from warmstart.snapshot.refs import resolve_ref
        from warmstart.snapshot.stores import open_store
        from warmstart.snapshot.verify import verify_cache, verify_snapshot

        cache = _cache(args)
        stores: list[Store] = []

        def store() -> Store:  # opened only when a blob must be fetched again or the ref needs resolving
            if not stores:
                stores.append(open_store(args.store))
            return stores[0]

        progress = not (args.quiet or args.json)
        if args.ref is None:
            report = verify_cache(cache, store, concurrency=args.concurrency, progress=progress)
        else:
            cached = cache.get_manifest(args.ref) if is_id(args.ref) else None
            sid = args.ref if cached is not None else resolve_ref(store(), args.ref)
            raw = cached or cache.get_manifest(sid) or store().get_manifest(sid)
            report = verify_snapshot(cache, sid, raw, store, concurrency=args.concurrency, progress=progress)
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        print_verify_report(report)
    if report.failed:
        raise CliError(f"{len(report.failed)} damaged blob(s) were removed from the cache but could not be downloaded "
                       f"again ({report.failed[0]}); pull the snapshot when the store is reachable")
    return 0


def print_verify_report(report: VerifyReport) -> None:
    what = f"snapshot {report.snapshot}" if report.snapshot else f"the cache {report.cache}"
    for b in report.bad:
        print(f"blob {b['blob']}: {b['problem']}; {b['action']}")
    for sid in report.bad_manifests:
        print(f"cached manifest of snapshot {sid} does not match its id; removed")
    missing = f", {report.blobs_missing} not in the cache" if report.blobs_missing else ""
    verdict = f"{len(report.bad)} damaged" if report.bad else "all whole"
    print(f"{what}: {report.blobs_checked} blobs checked ({report.bytes_checked:,} bytes) in {report.seconds:.2f} s, "
          f"{verdict}{missing}")


def cmd_ls(args: argparse.Namespace) -> int:
    """Exit status 0 when everything was listed; LS_INCOMPLETE when some manifests or refs cannot be read (they
    are flagged, the rest is listed); 1 when the store cannot be listed at all."""
    with user_errors():
        from warmstart.snapshot.errors import CorruptBlob
        from warmstart.snapshot.format import FormatError
        from warmstart.snapshot.stores import open_store

        store = open_store(args.store)
        refs, bad_refs = store.survey_refs()
        snapshots = store.list_snapshots()
        known = set(snapshots)
        rows: list[dict[str, Any]] = []
        problems: list[dict[str, str]] = []
        for sid in snapshots:
            try:
                rows.append(_ls_row(store, sid, refs))
            except (CorruptBlob, FormatError) as e:
                problems.append({"kind": "snapshot", "name": sid, "error": str(e)})
        problems += [{"kind": "ref", "name": name, "error": error} for name, error in bad_refs.items()]
        problems += [{"kind": "ref", "name": name, "error": f"ref {name!r} points at snapshot {sid}, which is not in "
                      f"{store.uri}; point it again with 'warmstart tag'"}
                     for name, sid in refs.items() if sid not in known]
    if args.json:
        print(json.dumps({"store": store.uri, "snapshots": rows, "refs": refs, "problems": problems}))
    else:
        for r in rows:
            print(f"{r['id']}  {r['architecture']:<20} {r['quant']:<5} {r['bytes'] / 1e6:9.1f} MB  "
                  f"refs: {', '.join(r['refs']) or '-'}  prefixes: {', '.join(r['prefixes']) or '-'}")
        for p in problems:
            label = p["name"] if p["kind"] == "snapshot" else f"ref {p['name']}"
            print(f"{label}  {'unreadable' if p['kind'] == 'snapshot' else 'broken'}: {p['error']}")
    if not problems:
        return 0
    entries = f"{len(problems)} {'entry' if len(problems) == 1 else 'entries'}"
    _log(args)(f"warmstart: warning: {entries} of {store.uri} cannot be used (marked above); "
               f"the rest is listed (exit status {LS_INCOMPLETE})")
    return LS_INCOMPLETE


def _ls_row(store: Any, sid: str, refs: dict[str, str]) -> dict[str, Any]:
    """The snapshot's line in `ls`; raises CorruptBlob or FormatError when its manifest cannot be read."""
    from warmstart.snapshot.format import FormatError, Manifest

    manifest = Manifest.decode(store.get_manifest(sid), where=f"snapshot {sid}")
    m = manifest.view()
    try:
        return {"id": sid, "refs": sorted(n for n, t in refs.items() if t == sid),
                "architecture": m.architecture, "quant": str(m.quantization["scheme"]),
                "bytes": sum(manifest.blob_sizes().values()), "prefixes": [str(p.name) for p in m.prefixes]}
    except (KeyError, TypeError, AttributeError) as e:
        raise FormatError(f"the manifest of snapshot {sid} lacks a field or has one of the wrong type "
                          f"({type(e).__name__}: {str(e)[:80]}); rebuild and push it") from None


def cmd_inspect(args: argparse.Namespace) -> int:
    with user_errors():
        from warmstart.snapshot.format import Manifest
        from warmstart.snapshot.refs import resolve_ref
        from warmstart.snapshot.stores import open_store

        store = open_store(args.store)
        sid = resolve_ref(store, args.ref)
        manifest = Manifest.decode(store.get_manifest(sid), where=f"snapshot {sid}")
    info = describe(sid, manifest)
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"snapshot {sid}: {info['architecture']}, {info['dtype']}, quantization {info['quantization']['scheme']}")
    print(f"  {len(info['tensors'])} tensors, {info['bytes']:,} bytes in {info['blobs']} blobs, "
          f"block size {info['block_size']}, built by {info['tool']}")
    if info["tensor_parallel"] > 1:
        print(f"  sharded for tensor parallelism {info['tensor_parallel']}: each rank pulls "
              f"{' / '.join(f'{b:,}' for b in info['bytes_per_rank'])} bytes (tensors listed: rank 0's)")
    for p in info["prefixes"]:
        print(f"  prefix {p['name']} ({p['kind']}): {p['tokens']} tokens, {p['cached_tokens']} in full blocks")
    for a in info["adapters"]:
        print(f"  adapter {a['name']} ({a['kind']}): {a['virtual_tokens']} virtual tokens, "
              f"{a['wasted_slots']} KV slots of padding")
    for lora in info["loras"]:
        print(f"  lora {lora['name']}: rank {lora['rank']}, {lora['bytes']:,} bytes in blob {lora['blob']}")
    if info["selector"] is not None:
        s = info["selector"]
        measured = f"{s['accuracy']:.1%} of {s['held_out']} held-out examples" if s["accuracy"] is not None else \
            "accuracy not measured (too few examples)"
        print(f"  adapter selector ('auto'): {len(s['adapters'])} adapters, {measured}")
    return 0


def describe(sid: str, manifest: Manifest) -> dict[str, Any]:
    world = manifest.tensor_parallel
    m = manifest.view(0)  # a sharded snapshot's tensors are listed as rank 0 holds them
    block_size = m.engine.block_size
    return {
        "id": sid,
        "architecture": m.architecture,
        "config": m.model_config,
        "dtype": m.engine.dtype,
        "block_size": block_size,
        "quantization": m.quantization,
        "tensors": {n: {"dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes} for n, t in m.tensors.items()},
        "bytes": sum(manifest.blob_sizes().values()),
        "tensor_parallel": world,
        "bytes_per_rank": [sum(manifest.blob_sizes(r).values()) for r in range(world)],
        "blobs": len(manifest.blob_sizes()),
        "prefixes": [{"name": p.name, "kind": p.kind, "tokens": len(p.token_ids),
                      "cached_tokens": p.cached_tokens(block_size)} for p in m.prefixes],
        "adapters": adapter_summaries(m),
        "loras": lora_summaries(m),
        "selector": selector_summary(m),
        "tool": m.provenance["tool"],
        "source": m.provenance.get("model"),  # hub id and commit, or GGUF file and hash; None for a directory
        **({"draft": {"architecture": m.draft.architecture, "quantization": m.draft.quantization,
                      "bytes": sum(t.nbytes or 0 for t in m.draft.tensors.values())}} if m.draft is not None else {}),
    }


def cmd_lora_push(args: argparse.Namespace) -> int:
    with user_errors():
        from warmstart.snapshot.adapters import AdapterSpec
        from warmstart.snapshot.errors import BuildError
        from warmstart.snapshot.lora import push_lora
        from warmstart.snapshot.stores import open_store

        try:
            spec = AdapterSpec.parse(args.adapter, "lora push")
            store = open_store(args.store)
            sid, document, stats = push_lora(store, _cache(args), spec, args.snapshot, log=_log(args))
        except BuildError as e:
            raise CliError(str(e)) from None
    result = {"name": spec.name, "snapshot": sid, "document": document, "store": store.uri,
              "blobs_total": stats.blobs_total, "blobs_uploaded": stats.blobs_uploaded,
              "bytes_uploaded": stats.bytes_uploaded}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{spec.name} -> snapshot {sid} (document {document})")
        _log(args)(f"{stats.blobs_uploaded} of {stats.blobs_total} blobs uploaded ({stats.bytes_uploaded:,} bytes)")
    return 0


def cmd_tag(args: argparse.Namespace) -> int:
    with user_errors():
        from warmstart.snapshot.refs import resolve_ref
        from warmstart.snapshot.store import check_new_ref_name
        from warmstart.snapshot.stores import open_store

        check_new_ref_name(args.name)
        store = open_store(args.store)
        sid = resolve_ref(store, args.ref)
        store.set_ref(args.name, sid)
    print(json.dumps({"ref": args.name, "id": sid}) if args.json else f"{args.name} -> {sid}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    with user_errors():
        from warmstart.snapshot.cache import default_cache_dir
        from warmstart.snapshot.gc import gc
        from warmstart.snapshot.stores import open_store

        store = open_store(args.store)
        report = gc(store, dry_run=args.dry_run, grace_seconds=args.grace_seconds,
                    cache_root=(args.cache or default_cache_dir()).expanduser().absolute())
    result = {"dry_run": args.dry_run, "blobs_deleted": report.blobs_deleted, "bytes_freed": report.bytes_freed,
              "kept": report.kept, "temporaries_deleted": report.temporaries_deleted,
              "temporary_bytes_freed": report.temporary_bytes_freed}
    if args.json:
        print(json.dumps(result))
    else:
        verb = "would delete" if args.dry_run else "deleted"
        print(f"{verb} {report.blobs_deleted} unreferenced blobs ({report.bytes_freed:,} bytes) and "
              f"{report.temporaries_deleted} stale temporary files ({report.temporary_bytes_freed:,} bytes)")
    return 0
