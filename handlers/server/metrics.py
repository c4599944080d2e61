"""`GET /metrics`: Prometheus text with the names vLLM users' dashboards already query, prefixed `warmstart:`.

Latency histograms are observed by the handler as requests finish. Engine counters and gauges are read
from one `EngineStats` taken at scrape time, so they are exactly the engine's own counts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from warmstart.runtime.timeline import Timeline

if TYPE_CHECKING:
    from warmstart.runtime.engine.lora import LoraStats
    from warmstart.runtime.engine.tensor_parallel import CommStats
    from warmstart.runtime.outputs import EngineStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
MAX_IGNORED_NAMES = 32
MAX_IGNORED_NAME_CHARS = 64
log = logging.getLogger("warmstart.requests")
PREFIX = "warmstart:"

# vLLM's buckets, so that dashboards built for it read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


class Metrics:
    def __init__(self, model_name: str, timeline: Timeline) -> None:
        self.model_name = model_name
        self.timeline = timeline
        self.stats: EngineStats | None = None  # set just before each scrape
        self.lora_stats: LoraStats | None = None  # likewise, while the engine serves LoRA adapters
        self.max_loras = 0  # LoRA adapters resident at once (the engine's max_loras), once it is loaded
        self.rank_loads: list[dict[str, Any]] = []  # tensor parallelism: each rank's pull and map
        self.comm: CommStats | None = None  # tensor parallelism: rank 0's collective times
        self.engine_info: dict[str, str] = {}  # device and ops, once the engine is loaded
        self.device_copy: dict[str, Any] | None = None  # the weights' copy to the device, when there was one
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token, from arrival.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, from arrival to its last token.",
                             REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time a request waited before it was scheduled.",
                               REQUEST_BUCKETS)
        self.success = Counter(PREFIX + "request_success", "Requests that finished, by finish reason.",
                               [*labels, "finished_reason"], registry=self.registry)
        for reason in ("stop", "length"):  # present from the start, at 0, as dashboards expect of a series
            self.success.labels(model_name, reason)
        self.ignored_fields = Counter(PREFIX + "request_ignored_fields", "Request fields accepted and ignored, by "
                                      "name.", [*labels, "field"], registry=self.registry)
        self.ignored_names: set[str] = set()  # names seen so far (logged once each), at most MAX_IGNORED_NAMES
        self.registry.register(_EngineCollector(self))

    def observe_request(self, ttft: float | None, queue: float | None, e2e: float, reason: str | None) -> None:
        name = self.model_name
        if ttft is not None:
            self.ttft.labels(name).observe(ttft)
        if queue is not None:
            self.queue.labels(name).observe(queue)
        self.e2e.labels(name).observe(e2e)
        if reason in ("stop", "length"):
            self.success.labels(name, reason).inc()

    def count_ignored(self, names: list[str]) -> None:
        """Count the fields a request sent that the server ignored; each new name is logged once at debug.
        Past MAX_IGNORED_NAMES distinct names (and names too long to be a field's) the rest count as "_other",
        so clients cannot grow the series without bound."""
        for name in names:
            if (name not in self.ignored_names and len(self.ignored_names) < MAX_IGNORED_NAMES
                    and len(name) <= MAX_IGNORED_NAME_CHARS):
                self.ignored_names.add(name)
                log.debug("ignoring request field %r (this server does not use it)", name[:80])
            self.ignored_fields.labels(self.model_name, name if name in self.ignored_names else "_other").inc()

    def observe_inter_token(self, seconds: float, tokens: int) -> None:
        child = self.itl.labels(self.model_name)
        for _ in range(tokens):
            child.observe(seconds / tokens)

    def render(self, stats: EngineStats | None, lora_stats: LoraStats | None = None) -> bytes:
        self.stats, self.lora_stats = stats, lora_stats
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m, stats = self.metrics, self.metrics.stats
        name = [m.model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running if stats else 0)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting if stats else 0)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full); pinned snapshot "
                    "prefix blocks count as used.", stats.kv_cache_usage if stats else 0.0)
        yield counter("prompt_tokens", "Prompt tokens computed (prefix cache hits not counted).",
                      stats.prompt_tokens if stats else 0)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens if stats else 0)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries if stats else 0)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      stats.prefix_cache_hits if stats else 0)
        yield counter("num_preemptions", "Sequences preempted for lack of KV cache blocks.",
                      stats.num_preemptions if stats else 0)
        if stats is not None and (stats.num_adapters or m.lora_stats is not None):
            # vLLM's LoRA info gauge: the labels carry the adapters in use, the value is when it was read. max_lora:
            # the adapters a batch can hold at once, compiled ones (always there) and LoRA slots (--max-loras).
            adapters = GaugeMetricFamily(PREFIX + "lora_requests_info", "Adapters of running and waiting requests.",
                                         labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            max_lora = stats.num_adapters + (m.max_loras if m.lora_stats is not None else 0)
            adapters.add_metric([str(max_lora), ",".join(stats.running_adapters),
                                 ",".join(stats.waiting_adapters)], time.time())
            yield adapters
        if m.lora_stats is not None:
            yield from _lora_metrics(m.lora_stats, name)
        yield counter("spec_decode_num_drafts", "Speculative verification passes (one per sequence and step).",
                      stats.spec_num_drafts if stats else 0)
        yield counter("spec_decode_num_draft_tokens", "Proposed tokens verified by the target.",
                      stats.spec_num_draft_tokens if stats else 0)
        yield counter("spec_decode_num_accepted_tokens", "Proposed tokens the target accepted.",
                      stats.spec_num_accepted_tokens if stats else 0)
        yield counter("spec_decode_num_emitted_tokens", "Tokens emitted by verification passes: the accepted "
                      "ones plus one from the target per pass.", stats.spec_num_emitted_tokens if stats else 0)
        yield gauge("spec_decode_draft_acceptance_rate", "Accepted over proposed tokens, since the start.",
                    stats.spec_acceptance_rate if stats else 0.0)
        if stats is not None and stats.kv_tier is not None:
            yield from _kv_tier_metrics(stats.kv_tier, counter)
        if m.engine_info:
            # An info gauge (value 1) as vLLM's cache_config_info: the labels say where and on what it serves.
            labels = ("device", "ops", "dtype", "cpu_isa", "matmul_dtype")
            info = GaugeMetricFamily(PREFIX + "engine_info", "Where the engine runs: device (cpu, cuda:N), ops "
                                     "(torch: PyTorch ops; triton: the Triton kernels), the model's dtype, on the CPU "
                                     "the kernels' instruction set (portable, avx2, avx512, avx512_bf16) and the "
                                     "dtype prefill's matmuls compute in.", labels=["model_name", *labels])
            info.add_metric([m.model_name, *(m.engine_info.get(k, "") for k in labels)], 1.0)
            yield info
        if m.device_copy is not None:
            yield GaugeMetricFamily(PREFIX + "device_copy_bytes", "Weight bytes copied to the device at cold start.",
                                    value=m.device_copy["bytes"])
            yield GaugeMetricFamily(PREFIX + "device_copy_seconds", "Seconds spent copying the weights to the "
                                    "device at cold start (reading the blobs and the transfers).",
                                    value=m.device_copy["seconds"])
        cold = GaugeMetricFamily(PREFIX + "cold_start_seconds", "When each cold-start phase ended, in seconds "
                                 "since the process started.", labels=["phase"])
        for phase, seconds in m.timeline.as_dict()["phases"].items():
            cold.add_metric([phase], seconds)
        yield cold
        if m.comm is not None:
            yield from _tensor_parallel_metrics(m.rank_loads, m.comm)


KV_TIER_METRICS = {  # counter name -> (its TierStats key, what it counts)
    "kv_tier_hit_blocks": ("hit_blocks", "KV blocks loaded from the KV tier instead of computed."),
    "kv_tier_hit_tokens": ("hit_tokens", "Prompt tokens whose KV was loaded from the KV tier."),
    "kv_tier_miss_blocks": ("miss_blocks", "Whole-segment KV blocks looked up in the KV tier and not found."),
    "kv_tier_miss_tokens": ("miss_tokens", "Prompt tokens looked up in the KV tier and not found."),
    "kv_tier_read_bytes": ("bytes_read", "Bytes read from the KV tier."),
    "kv_tier_written_bytes": ("bytes_written", "Bytes written to the KV tier."),
    "kv_tier_segments_written": ("segments_written", "KV segments written to the KV tier."),
    "kv_tier_load_seconds": ("load_seconds", "Seconds the KV tier's readers spent loading segments."),
    "kv_tier_faults": ("faults", "KV tier errors, timeouts and damaged segments (each computed instead)."),
    "kv_tier_writes_dropped": ("writes_dropped", "KV segments not written because the write queue was full."),
}


def _kv_tier_metrics(counters: dict[str, float], counter: Any) -> Iterator[Metric]:
    for metric, (key, doc) in KV_TIER_METRICS.items():
        yield counter(metric, doc, counters[key])


def _lora_metrics(stats: LoraStats, name: list[str]) -> Iterator[Metric]:
    """The engine's LoRA page-ins (runtime/engine/lora.py LoraStats). The engine keeps the count and the sum of load
    times, not each one, so the histogram has the +Inf bucket alone: its _sum over its _count is the mean."""
    load = HistogramMetricFamily(PREFIX + "lora_load_seconds", "Seconds to page a LoRA adapter into a device slot "
                                 "(read its blob, verify, copy).", labels=["model_name"])
    load.add_metric(name, [("+Inf", stats.loads)], stats.load_seconds)
    yield load
    for key, doc in (("hits", "Requests admitted whose LoRA adapter was already resident."),
                     ("misses", "Requests admitted whose LoRA adapter had to be paged in.")):
        family = CounterMetricFamily(PREFIX + f"lora_cache_{key}", doc, labels=["model_name"])
        family.add_metric(name, getattr(stats, key))
        yield family
    errors = CounterMetricFamily(PREFIX + "lora_load_errors", "LoRA adapter page-ins whose load failed (a blob "
                                 "gone or corrupt); the requests waiting for that adapter were aborted.",
                                 labels=["model_name"])
    errors.add_metric(name, stats.load_errors)
    yield errors


def _tensor_parallel_metrics(rank_loads: list[dict[str, Any]], comm: CommStats) -> Iterator[Metric]:
    for key, doc in (("pull_seconds", "Seconds each tensor-parallel rank spent pulling its blobs at cold start."),
                     ("map_seconds", "Seconds each tensor-parallel rank spent mapping its blobs at cold start."),
                     ("bytes_downloaded", "Bytes each tensor-parallel rank pulled at cold start.")):
        family = GaugeMetricFamily(PREFIX + f"tensor_parallel_rank_{key}", doc, labels=["rank"])
        for load in rank_loads:
            family.add_metric([str(load["rank"])], load[key])
        yield family
    yield CounterMetricFamily(PREFIX + "tensor_parallel_all_reduce_seconds", "Seconds rank 0 spent in the "
                              "decoder's all-reduces, over all steps (divide by the steps counter for a mean).",
                              value=comm.all_reduce_seconds)
    yield CounterMetricFamily(PREFIX + "tensor_parallel_gather_seconds", "Seconds rank 0 spent gathering the "
                              "vocabulary-split logits, over all steps.", value=comm.gather_seconds)
    yield CounterMetricFamily(PREFIX + "tensor_parallel_steps", "Forward steps run across the tensor-parallel group.",
                              value=comm.steps)
    yield GaugeMetricFamily(PREFIX + "tensor_parallel_last_step_all_reduce_seconds",
                            "Seconds the last step spent in all-reduces.", value=comm.last_step_all_reduce_seconds)
