"""Which snapshot a name given by the user means: a full id, a ref name, or a unique id prefix."""

from __future__ import annotations

from warmstart.snapshot.errors import NoSuchBucket, NotFound, StoreError
from warmstart.snapshot.format import is_id
from warmstart.snapshot.store import MIN_ID_PREFIX, Store, is_ref_name

MIN_PREFIX = MIN_ID_PREFIX  # shortest id prefix that resolve_ref accepts


def resolve_ref(store: Store, ref: str) -> str:
    """The snapshot id that ``ref`` names: a full id, a ref name, or a unique id prefix of at least 4 digits
    (looked up in that order: new refs may not look like a prefix, but one made before that rule still wins)."""
    ref = ref.strip()
    if not ref:
        raise StoreError("no snapshot given; pass an id, an id prefix or a ref name")
    if is_id(ref):
        if store.has_manifest(ref):
            return ref
        raise NotFound(f"snapshot {ref} not found in {store.uri} (try 'warmstart ls --store {store.uri}')")
    if is_ref_name(ref):
        try:
            return store.get_ref(ref)
        except NoSuchBucket:
            raise
        except NotFound:
            pass
    snapshots = store.list_snapshots()
    hexdigits = all(c in "0123456789abcdef" for c in ref)
    if hexdigits and len(ref) >= MIN_PREFIX:
        candidates = [s for s in snapshots if s.startswith(ref)]
        if len(candidates) == 1:
            return candidates[0]
        if candidates:
            raise StoreError(f"id prefix {ref!r} is ambiguous in {store.uri}: it matches "
                             f"{', '.join(candidates[:10])}{' ...' if len(candidates) > 10 else ''}; give more digits")
    refs, _ = store.survey_refs()  # a bad ref elsewhere must not hide what was asked
    short = hint = ""
    if hexdigits and len(ref) < MIN_PREFIX:
        short = f" (an id prefix needs at least {MIN_PREFIX} digits)"
    if refs:
        hint += f"refs: {', '.join(sorted(refs)[:10])}{' ...' if len(refs) > 10 else ''}; "
    if snapshots:
        hint += f"snapshots: {', '.join(s[:12] for s in snapshots[:10])}{' ...' if len(snapshots) > 10 else ''}"
    else:
        hint += "no snapshots"
    build = "build one with `warmstart build MODEL_DIR --tag NAME`"
    if "/" in ref and not ref.startswith(("/", ".")):
        build += f" (a hub id builds the same way: `warmstart build {ref} --tag NAME`)"
    raise NotFound(f"no snapshot or ref {ref!r} in {store.uri}{short}; {hint.rstrip('; ')}; {build}")
