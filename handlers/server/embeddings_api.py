"""POST /v1/embeddings: the inputs parsed and tokenized off the event loop (handlers/openai/embeddings.py), their
embeddings computed on the engine's thread between steps (runtime/engine/pooling.py), pooled as the server was
started to pool them (--embedding-pooling)."""

from __future__ import annotations

import asyncio
from typing import Any

from warmstart.handlers.openai.embeddings import embeddings_reply, parse_embeddings
from warmstart.handlers.openai.requests import APIError, bad
from warmstart.handlers.server.service import Service, on_engine


async def embeddings(service: Service, body: Any, pooling: str, model_name: str) -> dict[str, Any]:
    from warmstart.runtime.engine.pooling import PoolBusy, embed

    engine = service.llm.engine
    call = await asyncio.get_running_loop().run_in_executor(
        service.tokenizing, lambda: parse_embeddings(body, service.model, engine.config.hidden_size))
    try:
        vectors = await on_engine(service.llm, lambda: embed(engine, call.inputs, pooling))
    except PoolBusy as e:
        raise APIError(503, str(e), code="pool_busy", headers={"Retry-After": "1"}) from None
    except ValueError as e:
        raise bad(str(e), "input") from None
    return embeddings_reply(call, vectors, model_name)
