"""`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, in vLLM's shapes: LoRA adapters added to and
removed from a running server without a restart.

The body is vLLM's, ``{"lora_name": ..., "lora_path": ...}``; here ``lora_path`` names an adapter pushed to the
store against the served snapshot (`warmstart lora push NAME=DIR --snapshot ID`), whose blobs are pulled into the
cache and verified before the engine gets it. Success is vLLM's plain-text sentence; errors are 400 or 404 with
vLLM's messages, in OpenAI's error body. The API key guards these routes as every other
(handlers.server.app.BearerAuth).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.responses import PlainTextResponse, Response

from warmstart.handlers.openai.requests import APIError, bad
from warmstart.handlers.server.service import on_engine

if TYPE_CHECKING:
    from warmstart.handlers.server.state import ServeState
    from warmstart.runtime.async_engine import AsyncLLM
    from warmstart.runtime.engine.lora import LoraStats

LORA_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # as snapshot.adapters.ADAPTER_NAME


def _field(body: Any, name: str) -> str | None:
    value = body.get(name) if isinstance(body, dict) else None
    if value is not None and not isinstance(value, str):
        raise bad(f"'{name}' must be a string", name)
    return value or None


async def load_lora_adapter(state: ServeState, body: Any) -> Response:
    service = state.ready_service()
    name, path = _field(body, "lora_name"), _field(body, "lora_path")
    if name is None or path is None:
        raise bad("Both 'lora_name' and 'lora_path' must be provided.", code="InvalidUserInput")
    if not LORA_NAME.match(name) or name == "auto" or name == service.model.name:
        raise bad(f"lora_name {name[:80]!r} cannot name an adapter: use 1 to 64 letters, digits, '_', '.' or '-', "
                  "starting with a letter or digit (and not 'auto' or the base model's name)", "lora_name",
                  "InvalidUserInput")
    async with state.lora_lock:
        if name in service.model.adapters:
            raise bad(f"The lora adapter '{name}' has already been loaded.", "lora_name", "InvalidUserInput")
        entry, load = await asyncio.to_thread(_fetch, state, path)
        try:
            await on_engine(service.llm, lambda: service.llm.engine.add_lora(name, load, int(entry["rank"])))
        except ValueError as e:  # a rank above --max-lora-rank, say
            raise bad(f"cannot load LoRA adapter {path!r}: {e}", "lora_path", "BadRequestError") from None
        service.model.adapters[name] = 0  # no virtual tokens: a LoRA changes the weights' outputs, not the prompt
        state.loras[name] = {"name": name, "rank": int(entry["rank"]), "blob": entry["blob"], "source": path}
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


def _fetch(state: ServeState, path: str) -> tuple[dict[str, Any], Callable[[], Any]]:
    """Off the event loop: the adapter's blobs pulled and verified, and read once, so that a bad one fails here
    rather than at the first request that names it."""
    from warmstart.snapshot.errors import StoreError
    from warmstart.snapshot.format import FormatError
    from warmstart.snapshot.lora import LoraError, LoraNotFound

    if state.lora_source is None:
        raise bad("this server has no store to fetch LoRA adapters from", "lora_path", "BadRequestError")
    try:
        entry, load = state.lora_source.fetch(path)
        load()
    except LoraNotFound as e:
        raise APIError(404, f"No adapter found for lora_path {path!r}: {e}", param="lora_path",
                       code="NotFoundError") from None
    except (LoraError, StoreError, FormatError, ValueError, KeyError, TypeError) as e:
        raise bad(f"cannot load LoRA adapter {path!r}: {e}", "lora_path", "BadRequestError") from None
    return entry, load


async def unload_lora_adapter(state: ServeState, body: Any) -> Response:
    service = state.ready_service()
    name = _field(body, "lora_name")
    if name is None:
        raise bad("'lora_name' must be provided.", "lora_name", "InvalidUserInput")
    async with state.lora_lock:
        if name not in state.loras:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="NotFoundError")
        try:
            await on_engine(service.llm, lambda: service.llm.engine.remove_lora(name))
        except ValueError as e:  # requests still use it
            raise bad(f"cannot unload LoRA adapter '{name}': {e}", "lora_name", "BadRequestError") from None
        del service.model.adapters[name]
        del state.loras[name]
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def lora_stats(llm: AsyncLLM) -> LoraStats | None:
    """A copy of the engine's LoRA counters, taken between steps; None when it never had an adapter."""
    engine = llm.engine
    stats = await on_engine(llm, lambda: dataclasses.replace(engine.loras.stats) if engine.loras.names() or
                            engine.loras.stats.loads else None)
    return stats  # type: ignore[no-any-return]
