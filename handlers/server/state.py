"""What the server knows about itself: loading, ready or failed; the snapshot it serves; its timeline.

`load_snapshot` runs in the loading thread. It is the first thing in the process to import torch and the
snapshot loader, after the socket is bound, so that /health answers while they load.
"""

from __future__ import annotations

import asyncio
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warmstart.handlers.openai.requests import APIError, Prefix, ServedModel
from warmstart.handlers.server.kv_tier_options import KVTierConfig
from warmstart.handlers.server.kv_tier_options import attach as attach_kv_tier
from warmstart.handlers.server.manifest_summary import adapter_summaries, lora_summaries, selector_summary
from warmstart.handlers.server.metrics import Metrics
from warmstart.handlers.server.service import Service
from warmstart.runtime.timeline import Timeline

if TYPE_CHECKING:
    from warmstart.runtime.async_engine import AsyncLLM
    from warmstart.runtime.engine.tensor_parallel import TensorParallelGroup
    from warmstart.snapshot.lora import LoraSource

# What the server's info reports about the engine, in this order.
ENGINE_INFO = ("dtype", "block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
               "speculative", "num_speculative_tokens")


@dataclass
class Limits:
    max_queue: int = 256  # requests that may wait beyond the engine's max_num_seqs before a 429
    max_body_bytes: int = 2 << 20
    api_key: str | None = None
    body_timeout_s: float = 30.0  # a request body not all arrived by then is a 408
    sse_ping_s: float = 15.0  # an SSE stream idle this long gets a `: ping` comment
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed ("*": any); none: no CORS headers
    access_log: bool = False  # one JSON line per request on stdout (the serve command turns it on)


@dataclass
class ServeState:
    ref: str
    model_name: str
    timeline: Timeline
    limits: Limits = field(default_factory=Limits)
    url: str | None = None  # where it listens, once it does
    status: str = "loading"  # loading | ready | failed
    error: str | None = None
    service: Service | None = None
    info: dict[str, Any] = field(default_factory=dict)  # snapshot id, prefixes, adapters, pull, engine
    group: TensorParallelGroup | None = None  # rank 0's tensor-parallel group, when there is one
    reasoning_parser: str | None = None  # chat replies' <think> split out (handlers/openai/reasoning.py)
    tool_call_parser: str | None = None  # --tool-call-parser (handlers/openai/tool_calls.py); None: from the template
    special_tokens_in_content: bool = False  # --special-tokens-in-content (runtime/chat_content.py)
    tenant_header: str | None = None  # --tenant-header: each tenant's requests in a prefix cache chain of their own
    embedding_pooling: str = "last"  # --embedding-pooling: last or mean (runtime/engine/pooling.py)
    # LoRA adapters served (the snapshot's, and those loaded by POST /v1/load_lora_adapter): name -> summary
    loras: dict[str, dict[str, Any]] = field(default_factory=dict)
    lora_source: LoraSource | None = None  # where /v1/load_lora_adapter fetches adapters: the snapshot's store
    lora_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one load or unload at a time

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.model_name, self.timeline)

    @property
    def healthy(self) -> bool:
        return self.status == "ready" and self.service is not None and self.service.llm.is_alive

    def engine_failure(self) -> str | None:
        """Why a started engine stopped, or None while it runs (or before it starts)."""
        if self.service is None or self.service.llm.is_alive:
            return None
        return str(self.service.llm.error)

    def ready_service(self) -> Service:
        if self.service is not None:
            return self.service
        if self.status == "failed":
            raise APIError(503, f"the snapshot failed to load: {self.error}")
        raise APIError(503, "the model is still loading; retry when GET /health answers 200",
                       headers={"Retry-After": "1"})

    def set_ready(self, llm: AsyncLLM, model: ServedModel, info: dict[str, Any]) -> None:
        engine = llm.engine
        self.info = info
        self.service = Service(llm, model, self.metrics, self.timeline, engine.options.max_num_seqs,
                               self.limits.max_queue, self.limits.sse_ping_s)
        self.status = "ready"

    def fail(self, message: str) -> None:
        self.error = message
        self.status = "failed"

    def status_json(self) -> dict[str, Any]:
        return {"status": self.status, "model": self.model_name, "ref": self.ref, "url": self.url, **self.info,
                "loras": list(self.loras.values()), **self.timeline.as_dict(), "error": self.error}

    def shutdown(self) -> None:
        if self.service is not None:
            self.service.llm.shutdown()
            if self.service.llm.engine.admission.tier_link is not None:
                self.service.llm.engine.admission.tier_link.tier.close()  # the queued segments are written
        if self.group is not None:
            if self.status == "ready":  # after a failure the followers are gone or going, on their own
                self.group.stop_followers()
            self.group.close()


def load_snapshot(state: ServeState, store: str | None, cache: str | Path | None,
                  engine_options: dict[str, Any], tensor_parallel: int = 1, collective_timeout: float = 60.0,
                  device: str = "auto", kv_tier: KVTierConfig | None = None) -> None:
    """Pull (if need be), map and start the engine for ``state.ref`` on ``device`` (auto, cpu, cuda or cuda:N: a
    device that is not there fails the load before anything is pulled); the state ends ready or failed.

    With ``tensor_parallel`` > 1 this is rank 0 of a group joined through env:// (see handlers/cli/tensor_parallel.py):
    it pulls and maps its own shard, and gathers the other ranks' pull and map times."""
    timeline = state.timeline
    try:
        from warmstart.runtime.async_engine import AsyncLLM
        from warmstart.snapshot.cache import BlobCache
        from warmstart.snapshot.loader import load_with_report
        from warmstart.snapshot.lora import LoraSource

        timeline.mark("runtime_imports")
        blob_cache = BlobCache(cache)
        if tensor_parallel > 1:
            from warmstart.runtime.engine.tensor_parallel import TensorParallelGroup

            state.group = TensorParallelGroup(timeout_s=collective_timeout, device=device)
        llm, report = load_with_report(state.ref, store, blob_cache, group=state.group, device=device,
                                       **engine_options)
        rank_loads: list[Any] = []
        if state.group is not None:
            rank_loads = state.group.gather_objects(report.rank_load(0))
            report.timeline.add_details("mapped", ranks=rank_loads)  # every rank's own pull and map
        timeline.take(report.timeline)  # the load's phases (manifest ... mapped, kernels, graphs), at their times
        assert report.manifest is not None  # load_with_report always sets it
        manifest = report.manifest.view()
        engine = llm.engine
        summary = engine.summary()
        model = ServedModel(
            name=state.model_name,
            snapshot_id=report.snapshot_id,
            tokenizer=engine.tokenizer,
            vocab_size=engine.config.vocab_size,
            max_model_len=summary["max_model_len"],
            kv_cache_tokens=summary["kv_cache_tokens"],
            prefixes={p.name: Prefix(p.name, p.kind, list(p.token_ids)) for p in manifest.prefixes},
            adapters={**{name: a.num_tokens for name, a in engine.adapters.items()},
                      **{lora.name: 0 for lora in manifest.loras}},
            select_adapter=engine.inputs.select_adapter if summary["adapter_selector"] else None,
            kv_room=engine.inputs.kv_room,
            sampling_defaults=dict(engine.generation_defaults.sampling),
            reasoning_parser=state.reasoning_parser,
            tool_call_parser=state.tool_call_parser,
            special_tokens_in_content=state.special_tokens_in_content,
        )
        info = {
            "snapshot_id": report.snapshot_id,
            "prefixes": report.prefixes,
            "adapters": adapter_summaries(manifest),
            "adapter_selector": selector_summary(manifest),
            "pull": {"bytes_downloaded": report.bytes_downloaded, "blobs_downloaded": report.blobs_downloaded,
                     "blobs_total": report.blobs_total},
            "engine": {k: summary[k] for k in ENGINE_INFO},
            "device": summary["device"],
            "ops": summary["ops"],
            "cpu_isa": summary["cpu_isa"],
            "matmul_dtype": summary["matmul_dtype"],
        }
        if report.device_copy is not None:
            info["device_copy"] = report.device_copy
        state.loras = {lora["name"]: {**lora, "source": "snapshot"} for lora in lora_summaries(manifest)}
        state.lora_source = LoraSource(store, blob_cache, report.snapshot_id)
        state.metrics.engine_info = {k: str(summary[k] or "") for k in ("device", "ops", "dtype", "cpu_isa",
                                                                        "matmul_dtype")}
        state.metrics.max_loras = engine.options.max_loras
        state.metrics.device_copy = report.device_copy
        if state.group is not None:
            info["tensor_parallel"] = {"size": state.group.world, "backend": state.group.backend, "ranks": rank_loads}
            state.metrics.rank_loads, state.metrics.comm = rank_loads, state.group.stats
        if kv_tier is not None:
            info["kv_tier"] = attach_kv_tier(engine, report.snapshot_id, kv_tier)
        ready_at = time.monotonic()
        state.set_ready(AsyncLLM(engine), model, info)
        timeline.mark("ready", at=ready_at, url=state.url, snapshot_id=report.snapshot_id, model=state.model_name,
                      device=summary["device"], ops=summary["ops"], dtype=summary["dtype"], cpu_isa=summary["cpu_isa"],
                      matmul_dtype=summary["matmul_dtype"])
    except Exception as e:
        state.fail(_describe(e, state.ref))


def _describe(e: Exception, ref: str) -> str:
    """One sentence for a load that failed: the loader's own errors say what to do; anything else is a bug."""
    try:
        from warmstart.runtime.engine.device import DeviceError
        from warmstart.runtime.models.config import ModelConfigError
        from warmstart.snapshot.errors import StoreError
        from warmstart.snapshot.format import FormatError
        from warmstart.snapshot.loader import SnapshotError

        known: tuple[type[Exception], ...] = (StoreError, FormatError, SnapshotError, ModelConfigError, DeviceError)
    except Exception:  # the runtime itself failed to import (e's cause, which importing it again raises again)
        known = ()
    if isinstance(e, known):
        return str(e)
    if isinstance(e, ValueError):
        return f"cannot start the engine for snapshot {ref!r}: {e}"
    if isinstance(e, OSError):
        return f"cannot load snapshot {ref!r}: {e.strerror or e}" + (f" ({e.filename})" if e.filename else "")
    traceback.print_exc(file=sys.stderr)
    return f"loading snapshot {ref!r} failed: {type(e).__name__}: {e}"
