"""Cold start is the product: what each layer drags in when imported."""

from __future__ import annotations

from tests.support.imports import imported_after


def test_store_and_cache_import_without_torch() -> None:
    names = ("errors", "files", "format", "store", "s3", "cache", "progress", "transfer", "refs", "gc")
    modules = imported_after("import warmstart.snapshot" + "".join(f", warmstart.snapshot.{n}" for n in names))
    assert "torch" not in modules


def test_runtime_and_loader_never_import_transformers() -> None:
    modules = imported_after("import warmstart.runtime, warmstart.snapshot.loader")
    assert "torch" in modules
    assert not {m for m in modules if m.split(".")[0] in ("transformers", "peft")}


def test_serving_imports_neither_torch_nor_transformers_before_it_listens() -> None:
    modules = imported_after("import warmstart.handlers.cli.main, warmstart.handlers.server.app, "
                             "warmstart.handlers.cli.serve, warmstart.handlers.server.state, starlette, uvicorn")
    assert "torch" not in modules
    # of the engine's package only what imports no torch: the timeline the server marks its phases into, and the
    # engine's options, whose defaults the flags show
    engine_side = {m for m in modules if m.startswith("warmstart.runtime")}
    assert engine_side == {"warmstart.runtime", "warmstart.runtime.timeline", "warmstart.runtime.engine",
                           "warmstart.runtime.engine.options"}
    assert not {m for m in modules if m.split(".")[0] in ("transformers", "peft")}
