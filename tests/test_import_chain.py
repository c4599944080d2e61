"""Cold start is the product: what each layer drags in when imported."""

from __future__ import annotations

from tests.support.imports import imported_after


def test_store_and_cache_import_without_torch() -> None:
    modules = imported_after("import snapshot, snapshot.errors, snapshot.files, snapshot.format, snapshot.store, "
                             "snapshot.s3, snapshot.cache, snapshot.progress, snapshot.transfer, snapshot.refs, "
                             "snapshot.gc")
    assert "torch" not in modules


def test_runtime_and_loader_never_import_transformers() -> None:
    modules = imported_after("import runtime, snapshot.loader")
    assert "torch" in modules
    assert not {m for m in modules if m.split(".")[0] in ("transformers", "peft")}


def test_serving_imports_neither_torch_nor_transformers_before_it_listens() -> None:
    modules = imported_after("import handlers.cli.main, handlers.server.app, handlers.cli.serve, "
                             "handlers.server.state, starlette, uvicorn")
    assert "torch" not in modules and "runtime" not in modules
    assert not {m for m in modules if m.split(".")[0] in ("transformers", "peft")}
